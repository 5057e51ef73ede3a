"""AsyncLLM with the engine core in its own process: same tokens as the offline engine, aborts on
cancellation, errors that reach the caller, and a dead core detected."""
from __future__ import annotations

import asyncio
import os
import signal

import pytest

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.engine.async_llm import AsyncLLM, EngineDeadError
from engine_utils import wait_for

pytestmark = pytest.mark.slow  # AsyncLLM engines on the real model

KV_BYTES = 64 << 20
MAX_LEN = 1024
PROMPTS = [f"Write one sentence about the number {i}." for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


def engine_args(path: str, **kw) -> EngineArgs:
    return EngineArgs(path, device="cpu", dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN, **kw)


@pytest.fixture(scope="module")
def async_llm(smollm2_path):
    llm = AsyncLLM.from_engine_args(engine_args(smollm2_path))
    yield llm
    llm.shutdown()


async def collect(llm: AsyncLLM, prompt, params, request_id):
    outputs = [out async for out in llm.generate(prompt, params, request_id)]
    return outputs


def test_concurrent_requests_match_offline_engine(async_llm, smollm2_path):
    async def run():
        return await asyncio.gather(*[collect(async_llm, p, GREEDY, f"req-{i}") for i, p in enumerate(PROMPTS)])

    streams = asyncio.run(run())
    offline = LLM(smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN)
    expected = offline.generate(PROMPTS, GREEDY, use_tqdm=False)
    for stream, ref in zip(streams, expected):
        final = stream[-1]
        assert final.finished and all(not o.finished for o in stream[:-1])
        assert final.outputs[0].token_ids == ref.outputs[0].token_ids
        assert final.outputs[0].text == ref.outputs[0].text
        texts = [o.outputs[0].text for o in stream]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_cancelled_consumer_aborts_and_frees_blocks(async_llm):
    async def run():
        long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        seen = []

        async def consume():
            async for out in async_llm.generate("Tell me a very long story.", long, "to-cancel"):
                seen.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: len(seen) >= 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: async_llm.get_stats().num_running_reqs == 0 and async_llm.get_stats().kv_cache_usage == 0)
        return seen

    seen = asyncio.run(run())
    assert not seen[-1].finished


def test_explicit_abort_ends_the_stream(async_llm):
    async def run():
        outputs = []
        long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        async for out in async_llm.generate("Count to a thousand.", long, "to-abort"):
            outputs.append(out)
            if len(outputs) == 2:
                await async_llm.abort("to-abort")
        return outputs

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"


def test_invalid_requests_raise_before_reaching_the_engine(async_llm):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(async_llm, {"prompt_token_ids": [7] * MAX_LEN}, GREEDY, "too-long")
        with pytest.raises(ValueError, match="empty"):
            await collect(async_llm, "", GREEDY, "empty")
        # The engine still serves afterwards.
        return await collect(async_llm, "Hello", GREEDY, "after")

    assert asyncio.run(run())[-1].finished


def test_startup_failure_reports_the_core_error(smollm2_path):
    # A setting that does not fit the model or machine is a ValueError, as offline: the CLI's exit status 2.
    with pytest.raises(ValueError, match="max_model_len"):
        AsyncLLM.from_engine_args(EngineArgs(smollm2_path, device="cpu", num_gpu_blocks_override=2, max_model_len=512))


def test_dead_core_fails_requests(smollm2_path):
    llm = AsyncLLM.from_engine_args(engine_args(smollm2_path))

    async def run():
        long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
        seen = []

        async def consume():
            async for out in llm.generate("A long story:", long, "doomed"):
                seen.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: len(seen) >= 1)
        os.kill(llm.engine_pids[0], signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await task
        assert not llm.is_running
        with pytest.raises(EngineDeadError):
            await collect(llm, "Hello", GREEDY, "after-death")

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_core_exits_when_the_api_process_is_killed(smollm2_path, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "api.py"
    script.write_text(
        "import sys, time\n"
        "from pagellm import EngineArgs\n"
        "from pagellm.engine.async_llm import AsyncLLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = AsyncLLM.from_engine_args(EngineArgs({smollm2_path!r}, device='cpu', dtype='float32',\n"
        f"                                             kv_cache_memory_bytes={KV_BYTES}, max_model_len={MAX_LEN}))\n"
        "    print(llm.engine_pids[0], flush=True)\n"
        "    time.sleep(600)\n")
    api = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    core_pid = int(api.stdout.readline())
    os.kill(api.pid, signal.SIGKILL)
    api.wait()
    deadline = time.monotonic() + 30
    while _alive(core_pid):
        assert time.monotonic() < deadline, "engine core outlived its API process"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by init) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"
