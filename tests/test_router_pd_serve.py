"""`pagellm router --prefill ... --decode ...` in front of real `pagellm serve` engines of the embedded
model, a kv_producer and two kv_consumers (NixlConnector): greedy text and logprobs equal a single
server's (streamed and not) with every prompt's KV pulled, `pagellm bench serve` runs through it
unchanged, concurrent requests of which some are cut leave no KV blocks held on any engine, and
(last: it kills an engine) a decode engine killed mid-stream fails its request while the other
decode engine keeps serving."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from conftest import SHARED_SERVER_FLAGS, SHARED_SERVER_NAME
from router_utils import wait_until
from server_utils import RemoteServer, free_port, is_idle, metric_samples

from pagellm.cli import main as cli_main

pytestmark = pytest.mark.slow

KILL_TIMEOUT_S = 30.0
"""Bound on the stream's end after its engine dies (it should be immediate: the socket closes)."""
ABORT_TIMEOUT_S = 20
"""The producer frees blocks no consumer pulled after this (a request cut between its two legs)."""


def _role(name: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_role": name, "kv_connector_extra_config": {
        "side_channel_port": free_port(), "abort_timeout_s": ABORT_TIMEOUT_S}})


@pytest.fixture(scope="module")
def prefill_server(smollm2_path: str):
    remote = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS, *_role("kv_producer"))
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def decode_servers(smollm2_path: str):
    """Two consumers; the last test kills the first."""
    started: list[RemoteServer] = []
    try:
        for _ in range(2):
            started.append(RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS, *_role("kv_consumer")))
        yield started
    finally:
        for remote in started:
            remote.stop()


@pytest.fixture
def pd_router(router, prefill_server, decode_servers):
    return router({"prefill": [prefill_server.url], "decode": [d.url for d in decode_servers]})


def _outcomes(url: str) -> dict[str, float]:
    """The router's P/D request and fallback counters."""
    return {k: v for k, v in metric_samples(url).items()
            if k.startswith(("pagellm:router_pd_requests_total", "pagellm:router_pd_fallbacks_total"))}


def test_greedy_output_equals_a_single_server(pd_router, decode_servers, smollm2_server) -> None:
    routed = openai.OpenAI(base_url=f"{pd_router.url}/v1", api_key="unused", max_retries=0)
    single = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    story = "Once upon a time, " + "there was a small village by the sea. " * 60  # about 550 tokens
    prompts = ["The capital of France is", story, story + " One day"]  # the last hits the producer's cache
    for prompt in prompts:
        kwargs = dict(model=SHARED_SERVER_NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        want = single.completions.create(**kwargs).choices[0]
        got = routed.completions.create(**kwargs, extra_headers={"x-pagellm-cache-bypass": "1"}).choices[0]
        assert got.text == want.text
        assert got.logprobs.tokens == want.logprobs.tokens
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-3)
        stream = routed.completions.create(**kwargs, stream=True, extra_headers={"x-pagellm-cache-bypass": "1"})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    messages = [{"role": "user", "content": "Name three colours."}]
    want_chat = single.chat.completions.create(model=SHARED_SERVER_NAME, messages=messages, max_tokens=10,
                                               temperature=0).choices[0].message.content
    stream = routed.chat.completions.create(model=SHARED_SERVER_NAME, messages=messages, max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage.completion_tokens == 10  # the decode engine's own usage
    assert [m.id for m in routed.models.list().data] == [SHARED_SERVER_NAME]
    num_requests = 2 * len(prompts) + 1
    assert _outcomes(pd_router.url) == {"pagellm:router_pd_requests_total": num_requests}  # no fallback
    pulled = [metric_samples(d.url) for d in decode_servers]
    # The long prompt's KV was pulled, not computed (its repeats hit the decode engine's own prefix cache).
    assert sum(m["pagellm:kv_transfer_hit_tokens_total"] for m in pulled) > 500
    assert sum(m["pagellm:kv_transfer_failures_total"] for m in pulled) == 0


def test_bench_serve_through_the_router(pd_router, tmp_path, capsys) -> None:
    path = tmp_path / "serve.json"
    assert cli_main(["bench", "serve", "--base-url", pd_router.url + "/v1", "--num-prompts", "4", "--input-len",
                     "16", "--output-len", "4", "--disable-tqdm", "--output-json", str(path)]) == 0
    capsys.readouterr()
    result = json.loads(path.read_text())
    assert result["model_id"] == SHARED_SERVER_NAME and result["usage_from_server"]
    assert result["completed"] == 4 and result["failed"] == 0 and result["output_lens"] == [4] * 4
    assert _outcomes(pd_router.url) == {"pagellm:router_pd_requests_total": 4}  # no fallback


async def _churn(url: str, num_kept: int, num_cut: int) -> list[httpx.Response]:
    """`num_kept` requests answered in full and `num_cut` whose client goes mid-flight (half while
    streaming, half before a non-streamed answer), all at once; the kept ones' responses."""
    long = {"model": SHARED_SERVER_NAME, "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def cut(http: httpx.AsyncClient, i: int) -> None:
        if i % 2:
            async with http.stream("POST", "/v1/completions", json={**long, "prompt": f"Story {i}:",
                                                                    "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        return  # closing the stream mid-flight
        with pytest.raises(asyncio.TimeoutError):  # 400 tokens of 30 requests take far longer
            await asyncio.wait_for(http.post("/v1/completions", json={**long, "prompt": f"Story {i}:"}), 1.0)

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        kept = [http.post("/v1/completions", json={"model": SHARED_SERVER_NAME, "prompt": f"Fact {i}:",
                                                   "max_tokens": 8, "ignore_eos": True, "temperature": 0})
                for i in range(num_kept)]
        results = await asyncio.gather(*kept, *(cut(http, i) for i in range(num_cut)))
    return results[:num_kept]


def test_cut_requests_leave_no_blocks_held(pd_router, prefill_server, decode_servers) -> None:
    engines = (prefill_server, *decode_servers)

    def finished(reason: str, servers: tuple[RemoteServer, ...]) -> float:
        return sum(metric_samples(e.url).get(f"pagellm:request_success_total{{{reason}}}", 0) for e in servers)

    before = {"abort": finished("abort", engines), "length": finished("length", tuple(decode_servers))}
    num_kept, num_cut = 20, 10
    responses = asyncio.run(_churn(pd_router.url, num_kept, num_cut))
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    # A request cut between its two legs leaves its blocks on the producer until abort_timeout_s.
    wait_until(lambda: all(_nothing_held(e.url) for e in engines), 3 * ABORT_TIMEOUT_S)
    # No cut request ran on to its 400 tokens: the decode engines finished only the kept ones.
    assert finished("length", tuple(decode_servers)) - before["length"] == num_kept
    # The streams cut mid-decode were aborted there (a request cut between its legs is aborted nowhere).
    assert finished("abort", engines) - before["abort"] >= num_cut // 2
    assert all(b.in_flight == 0 and b.outstanding_tokens == 0 for b in pd_router.state.table.backends.values())


def _nothing_held(url: str) -> bool:
    samples = metric_samples(url)
    return is_idle(samples) and samples["pagellm:kv_transfer_held_requests"] == 0


def test_decode_engine_killed_mid_stream(pd_router, decode_servers) -> None:
    """Last in the module: it kills a decode engine. Its stream ends with an error event at once,
    and later requests go to the other decode engine, still with the prefill's KV."""
    victim, survivor = decode_servers
    pd_router.state.table.backends[survivor.url].outstanding_tokens = 10**9  # the victim takes the stream
    body = {"model": SHARED_SERVER_NAME, "prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events: list[str] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{pd_router.url}/v1/completions", json=body, timeout=KILL_TIMEOUT_S) as resp:
        assert resp.status_code == 200 and resp.headers["x-pagellm-backend"] == victim.url
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 1:  # the stream has started: kill its engine, server and engine core
                engine_pid = victim.engine_pid()
                killed = time.monotonic()
                victim.process.send_signal(signal.SIGKILL)
                os.kill(engine_pid, signal.SIGKILL)
    assert time.monotonic() - killed < 5 and time.monotonic() - started < KILL_TIMEOUT_S
    assert "[DONE]" not in events and len(events) < body["max_tokens"]
    assert f"backend {victim.url} broke off the stream" in json.loads(events[-1])["error"]["message"]
    victim.process.wait(timeout=KILL_TIMEOUT_S)
    pd_router.state.table.backends[survivor.url].outstanding_tokens = 0
    for i in range(3):
        resp = httpx.post(f"{pd_router.url}/v1/completions", timeout=60, json={
            "model": SHARED_SERVER_NAME, "prompt": f"Hello {i}", "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200 and resp.headers["x-pagellm-backend"] == survivor.url
    assert _outcomes(pd_router.url) == {"pagellm:router_pd_requests_total": 4}  # every one transferred
