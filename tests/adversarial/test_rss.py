"""The API process's memory under bursts of large but valid bodies (each under the 2 MiB body limit, all
at once): long prompts cut by truncate_prompt_tokens, a logit_bias over most of the vocabulary, megabytes
of metadata, a thousand tools, an extra message field of a megabyte. Each burst is answered in full; the
process's RSS peaks within a bound while the bodies are held and comes back to within a few tens of MiB
of where it was after the first burst (which sets up the allocator's arenas and caches), burst after
burst. (tests/test_admission.py checks refused huge bodies one at a time.)"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import Counter
from collections.abc import Iterator

import httpx
import psutil
import pytest

from adversarial.probes import AUTH, HI, MODEL, assert_serves_normally, wait_settled

pytestmark = pytest.mark.slow  # the shared adversary server (conftest.py)

BODY_CHARS = 1_000_000
NUM_BURSTS = 3
COPIES = 2
"""Each body sent this many times at once in a burst."""
PEAK_GROWTH_MIB = 600
"""The most the process may hold above its start during a burst: the bodies, their parsed objects and
the tokenizer's work for about 14 MB of requests."""
SETTLED_GROWTH_MIB = 40
"""The most the process may grow from the first burst's end to the last's."""
TOTAL_GROWTH_MIB = 150
"""The most it may grow over the whole run (the first burst's arenas included)."""
TIMEOUT_S = 180.0


def bodies() -> list[tuple[str, bytes]]:
    text = ("lorem ipsum dolor sit amet " * (BODY_CHARS // 27 + 1))[:BODY_CHARS]
    metadata = {f"k{i}": "v" * 100 for i in range(BODY_CHARS // 110)}
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 1000, "parameters": {"type": "object"}}}
    requests = [
        ("/v1/completions", {"prompt": text, "max_tokens": 1, "truncate_prompt_tokens": 8}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 1,
                                  "truncate_prompt_tokens": 8}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 0.5 for i in range(40_000)}}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 1, "metadata": metadata}),
        ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 1, "metadata": metadata}),
        ("/v1/chat/completions", {"messages": HI, "max_tokens": 1, "tool_choice": "none",
                                  "tools": [{**tool, "function": {**tool["function"], "name": f"f{i}"}}
                                            for i in range(BODY_CHARS // 1100)]}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi", "notes": text}]}),
    ]
    return [(path, json.dumps(body).encode()) for path, body in requests]


@contextlib.contextmanager
def peak_rss(process: psutil.Process) -> Iterator[list[int]]:
    """The process's largest RSS while the block runs, sampled from a thread of its own: [bytes]."""
    peak = [process.memory_info().rss]
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], process.memory_info().rss)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        stop.set()
        thread.join()


async def burst(url: str, requests: list[tuple[str, bytes]]) -> Counter:
    headers = {**AUTH, "Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=TIMEOUT_S,
                                 limits=httpx.Limits(max_connections=None)) as http:
        sent = requests * COPIES
        responses = await asyncio.gather(*[http.post(path, content=body) for path, body in sent])
    return Counter((path, response.status_code) for (path, _), response in zip(sent, responses))


def test_rss_comes_back_after_bursts_of_large_valid_bodies(adversary):
    api = psutil.Process(adversary.process.pid)
    requests = bodies()
    assert all(len(body) < 2 << 20 for _, body in requests) and sum(len(b) for _, b in requests) > 6_000_000
    start_mib = api.memory_info().rss >> 20
    settled_mib = []
    with peak_rss(api) as peak:
        for _ in range(NUM_BURSTS):
            answered = asyncio.run(burst(adversary.url, requests))
            assert set(status for _, status in answered) == {200}, answered
            wait_settled(adversary)
            settled_mib.append(api.memory_info().rss >> 20)
    peak_mib = peak[0] >> 20
    summary = f"RSS MiB: start {start_mib}, peak {peak_mib}, after each burst {settled_mib}"
    print(summary)
    assert peak_mib - start_mib < PEAK_GROWTH_MIB, summary
    assert settled_mib[-1] - settled_mib[0] < SETTLED_GROWTH_MIB, summary
    assert settled_mib[-1] - start_mib < TOTAL_GROWTH_MIB, summary
    assert_serves_normally(adversary, AUTH)
