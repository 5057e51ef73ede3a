"""Ranks that hang, and ranks started from a plain script (issue 53).

A stopped rank (SIGSTOP: alive, never answering) fails the engine once a step's results are later
than --engine-step-timeout, with an error naming it; every rank is stopped and the server exits 1.
`mp` ranks never re-run the caller's `__main__`, so a script without a main guard works.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from engine_utils import TINY_LLAMA
from server_utils import RemoteServer

from pagellm import LLM, SamplingParams
from pagellm.config import ParallelConfig
from pagellm.executor.base import WorkerFailedError, hung_step_reason, step_timeout_s

pytestmark = pytest.mark.usefixtures("stop_ray_after_module")

STEP_TIMEOUT_S = 3.0
"""Short, for the tests; a healthy decode step of the tiny model takes milliseconds."""
TINY = {"load_format": "dummy", "device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": 1 << 24}


@pytest.fixture
def tiny_dir(tmp_path: Path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(map(_gone, pids)):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not _gone(p)]}"
        time.sleep(0.05)


def test_a_late_step_names_the_stopped_rank_and_the_flag():
    parallel = ParallelConfig(tensor_parallel_size=2, step_timeout_s=3.0, step_timeout_per_token_s=0.05)
    assert step_timeout_s(parallel, 40) == pytest.approx(5.0)
    assert step_timeout_s(ParallelConfig(), 40) is None
    running, stopped = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        os.kill(stopped.pid, signal.SIGSTOP)
        os.waitpid(stopped.pid, os.WUNTRACED)  # returns once it has stopped
        assert hung_step_reason(parallel, 40, [running.pid, stopped.pid]) == (
            "no result for a step of 40 tokens within 5.0 s (engine_step_timeout (--engine-step-timeout) 3 s + "
            f"50 ms a token): rank 1 (pid {stopped.pid}) is stopped (SIGSTOP or a debugger)")
        # A rank on another machine (None) is not looked up.
        assert hung_step_reason(parallel, 1, [running.pid, None]).endswith(
            "a step of 1 token within 3.0 s (engine_step_timeout (--engine-step-timeout) 3 s + 50 ms a token): "
            "a rank is stuck (in a kernel or a deadlock)")
    finally:
        for proc in (running, stopped):
            proc.kill()
            proc.wait()


@pytest.mark.slow  # ranks in processes of their own (each starts Python and imports torch); Ray a cluster
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_stopped_rank_fails_the_engine_within_the_step_timeout_and_no_rank_is_left(tiny_dir, backend):
    llm = LLM(tiny_dir, **TINY, tensor_parallel_size=2, distributed_executor_backend=backend,
              engine_step_timeout=STEP_TIMEOUT_S)
    engine = llm.llm_engine
    pids = engine.engine_core.executor.pids
    engine.add_request("0", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    for _ in range(3):
        engine.step()
    # Rank 1 is not the driver: the engine waits on rank 0, which waits on rank 1 in an all-reduce.
    os.kill(pids[1], signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with pytest.raises(WorkerFailedError, match=rf"rank 1 \(pid {pids[1]}\) is stopped"):
            while engine.has_unfinished_requests():
                engine.step()
        # One decode token: the timeout plus 50 ms, and the poll's granularity.
        assert time.monotonic() - stopped < STEP_TIMEOUT_S + 2
        _wait_gone(pids)  # Ray reaps killed actors' processes by itself, shortly after
    finally:
        for pid in pids:  # the test failed: leave nothing stopped behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_server_with_a_stopped_rank_fails_the_request_naming_it_and_exits_1_leaving_no_process(tiny_dir):
    server = RemoteServer(tiny_dir, "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
                          "--kv-cache-memory-bytes", str(1 << 24), "--tensor-parallel-size", "2",
                          "--engine-step-timeout", str(STEP_TIMEOUT_S), "--served-model-name", "m")
    processes = psutil.Process(server.process.pid).children(recursive=True)  # engine core and ranks
    try:
        ranks = [p.pid for p in processes if "pagellm.executor.mp_rank" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGSTOP)
        stopped = time.monotonic()
        response = httpx.post(f"{server.url}/v1/completions", timeout=30.0,
                              json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True})
        assert time.monotonic() - stopped < STEP_TIMEOUT_S + 5
        assert response.status_code == 503
        assert f"rank 1 (pid {ranks[1]}) is stopped" in response.json()["error"]["message"]
        assert server.process.wait(timeout=30) == 1
        _wait_gone([p.pid for p in processes])
    finally:
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        server.stop()


@pytest.mark.slow  # a Python subprocess that starts two ranks
def test_a_plain_script_without_a_main_guard_runs_tensor_parallel_ranks(tiny_dir, tmp_path):
    marker = tmp_path / "top_level_runs.txt"
    script = tmp_path / "plain.py"
    script.write_text(f"""\
from pagellm import LLM, SamplingParams

with open({str(marker)!r}, "a") as f:
    f.write("ran\\n")
llm = LLM({tiny_dir!r}, **{TINY!r}, tensor_parallel_size=2)
out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print("tokens:", len(out[0].outputs[0].token_ids))
""")
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tokens: 4" in result.stdout
    assert marker.read_text() == "ran\n", "a rank ran the script's top level"
