"""Data parallel: replicas behind one API process, routed by prompt prefix and by load."""
from __future__ import annotations

import asyncio
import os
import signal

import httpx
import pytest

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.engine.async_llm import AsyncLLM, EngineDeadError
from pagellm.engine.dp_router import DataParallelRouter
from engine_utils import wait_for
from server_utils import RemoteServer, metric_samples

CPU = {"device": "cpu", "dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 64 << 20}
LIBRARY = "You are a meticulous assistant for a small public library. You answer briefly and never invent facts. "
PIRATE = "Pretend you are a pirate captain sailing the seven seas, and answer every question in pirate speech. "
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


def _prompts(n: int) -> list[str]:
    """Two shared prefixes, interleaved, each followed by its own question."""
    return [(LIBRARY if i % 2 == 0 else PIRATE) * 2 + f"Question {i}: what should I read next?" for i in range(n)]


# -- the router alone -----------------------------------------------------------------------------------

def test_router_follows_prefixes_balances_load_and_skips_dead_replicas():
    router = DataParallelRouter(2, block_size=4)
    a, b = list(range(100, 120)), list(range(200, 220))
    alive = [True, True]
    assert router.route(a + [1], 25, [0, 0], alive) == 0
    assert router.route(b + [2], 25, [25, 0], alive) == 1          # new prefix: the idlest
    assert router.route(a[:12] + [3, 4], 25, [25, 25], alive) == 0  # 12 shared tokens: 2 blocks
    assert router.route(b + [5], 25, [50, 25], alive) == 1
    # Far more work queued where the prefix lives than twice the idlest replica's: go there instead.
    assert router.route(a + [6], 25, [400, 25], alive) == 1
    assert router.route(a + [7], 25, [400, 25], alive) == 1         # and the prefix now lives there
    assert router.route(a + [8], 25, [0, 400], [True, False]) == 0  # a dead replica gets nothing
    assert router.route([9, 9], 5, [10, 3], alive) == 1             # shorter than a block: by load
    assert router.num_prefix_routed == 3 and router.num_routed == 8


# -- replicas in-process behind AsyncLLM ---------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_texts() -> list[str]:
    llm = LLM(**CPU)
    return [o.outputs[0].text for o in llm.generate(_prompts(64), GREEDY, use_tqdm=False)]


@pytest.mark.slow  # replicas of the default (real) model
def test_two_replicas_serve_64_concurrent_requests_by_prefix_with_the_outputs_of_one(reference_texts):
    llm = AsyncLLM.from_engine_args(EngineArgs(**CPU, data_parallel_size=2))
    routed: dict[tuple[int, ...], int] = {}  # the prompt's first tokens (its prefix) -> replica
    route = llm.router.route

    def recording_route(prompt_token_ids, *args):
        replica = route(prompt_token_ids, *args)
        assert routed.setdefault(tuple(prompt_token_ids[:8]), replica) == replica, "a prefix went to both replicas"
        return replica

    llm.router.route = recording_route

    async def one(i: int, prompt: str) -> str:
        text = ""
        async for out in llm.generate(prompt, GREEDY, str(i)):
            text = out.outputs[0].text
        return text

    async def run() -> list[str]:
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(_prompts(64))))

    try:
        texts = asyncio.run(run())
        assert texts == reference_texts
        assert sorted(routed.values()) == [0, 1]  # one prefix on each replica
        stats = [core.stats for core in llm._cores]
        assert all(s.num_generation_tokens > 0 for s in stats)
        assert all(s.prefix_cache_hits > 0 for s in stats)
        assert llm.router.num_prefix_routed == 62
        assert llm.get_stats().num_generation_tokens == sum(s.num_generation_tokens for s in stats)
    finally:
        llm.shutdown()


@pytest.mark.slow  # replicas of the default (real) model
def test_a_dead_replica_fails_its_requests_while_the_other_finishes_its_own():
    llm = AsyncLLM.from_engine_args(EngineArgs(**CPU, data_parallel_size=2))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    progress = {"0": 0, "1": 0}  # tokens received (one output may carry several steps' tokens)

    async def consume(request_id: str, prompt: str) -> str:
        text = ""
        async for out in llm.generate(prompt, long, request_id):
            progress[request_id] = len(out.outputs[0].token_ids)
            text = out.outputs[0].text
        return text

    async def run():
        survivor = asyncio.create_task(consume("0", LIBRARY * 2))
        doomed = asyncio.create_task(consume("1", PIRATE * 2))
        await wait_for(lambda: progress["0"] >= 1 and progress["1"] >= 1)
        os.kill(llm.engine_pids[llm._core_of["1"].index], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await doomed
        assert not llm.is_running
        with pytest.raises(EngineDeadError):  # no new requests once a replica is gone
            async for _ in llm.generate("Hello", GREEDY, "late"):
                pass
        return await survivor

    try:
        text = asyncio.run(run())
        assert len(text) > 0 and progress["0"] == 40
    finally:
        llm.shutdown()


# -- through the server ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_server_with_two_replicas_labels_metrics_by_engine(smollm2_path, reference_texts):
    server = RemoteServer(smollm2_path, "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
                          "--kv-cache-memory-bytes", str(64 << 20), "--data-parallel-size", "2",
                          "--served-model-name", "m")

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0) as http:
            async def one(prompt: str) -> str:
                response = await http.post("/v1/completions", json={"model": "m", "prompt": prompt,
                                                                     "max_tokens": 8, "temperature": 0.0})
                response.raise_for_status()
                return response.json()["choices"][0]["text"]
            return await asyncio.gather(*(one(p) for p in _prompts(16)))

    try:
        assert asyncio.run(run()) == reference_texts[:16]
        text = httpx.get(f"{server.url}/metrics").text
        for engine in ("0", "1"):
            line = next(l for l in text.splitlines()
                        if l.startswith("pagellm:generation_tokens_total") and f'engine="{engine}"' in l)
            assert float(line.split()[-1]) > 0, line
        assert metric_samples(server.url)["pagellm:http_requests_turned_away_total{at_capacity}"] == 0
    finally:
        assert server.stop() == 0
