"""The GPU benchmark script's CPU path (every phase with tiny sizes) and its phase runner."""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import pytest

# `benchmarks` is a folder of the repository, not part of the installed package.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import gpu_fast_path  # noqa: E402
from benchmarks.phases import PhaseRunner  # noqa: E402
from test_bench_cli import TINY_LLAMA  # noqa: E402

KERNEL_TESTS = """
def test_one():
    assert True

def test_two():
    assert 1 + 1 == 2

def test_broken():
    assert 1 + 1 == 3
"""


def test_phase_runner_records_each_outcome_and_goes_on():
    runner = PhaseRunner(budget_s=60.0, caps={"slow": 0.3})

    def spin(deadline: float) -> None:
        while True:  # only the alarm ends this
            pass

    assert runner.run("ok", lambda deadline: {"value": 1}) == {"value": 1}
    assert runner.run("slow", spin) is None
    assert runner.run("broken", lambda deadline: 1 / 0) is None
    records = runner.records
    assert records["ok"]["status"] == "ok" and records["ok"]["result"] == {"value": 1}
    assert records["slow"]["status"] == "timed_out" and records["slow"]["seconds"] < 5
    assert records["broken"]["status"] == "failed" and "ZeroDivisionError" in records["broken"]["error"]
    assert runner.ok("ok") and not runner.ok("slow")

    deadlines = []
    runner.run("deadline", lambda deadline: deadlines.append(deadline - time.perf_counter()))
    assert 0 < deadlines[0] < 60  # the phase is told when to stop, before its alarm
    spent = PhaseRunner(budget_s=0.0, caps={})
    assert spent.run("late", lambda deadline: {}) is None and spent.records["late"]["status"] == "skipped"


@pytest.mark.slow  # the real model and the Hugging Face reference
def test_smoke_run_on_the_cpu(tmp_path, capsys):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([{"conversations": [{"from": "human", "value": " ".join(words[:4 + i])},
                                                       {"from": "gpt", "value": " ".join(words[i:])}]}
                                    for i in range(6)]))
    kernel_tests = tmp_path / "test_kernels.py"
    kernel_tests.write_text(KERNEL_TESTS)
    engine = ["--model", str(model), "--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
              "--kv-cache-memory-bytes", str(16 << 20)]
    requests_file = str(tmp_path / "sharegpt_requests.json.gz")
    assert gpu_fast_path.main([*engine, "--smoke", "--dataset-path", str(sharegpt),
                               "--write-sharegpt-requests", requests_file]) is None

    payload = gpu_fast_path.main([*engine, "--smoke", "--sharegpt-requests", requests_file, "--check-backend",
                                  "torch", "--kernel-tests", str(kernel_tests), "missing_test.py", "--no-save",
                                  "--out-dir", str(tmp_path / "out"), "--commit", "abc123"])
    out = capsys.readouterr().out
    phases = payload["phases"]
    assert {name: r["status"] for name, r in phases.items() if r["status"] != "ok"} == {}
    assert list(phases) == ["ceilings", "kernel_tests", "datasets.random", "datasets.sharegpt", "backend_check",
                            "engine.load", "engine.sampling_features", "engine.batch1_decode", "engine.random",
                            "engine.sharegpt", "hf.load", "hf.sharegpt", "hf.random", "hf.batch1_decode"]
    assert payload["git"]["commit"] == "abc123"
    [written] = (tmp_path / "out").iterdir()
    assert json.loads(written.read_text())["phases"]["engine.random"] == json.loads(json.dumps(phases["engine.random"]))

    tests = phases["kernel_tests"]["result"]
    assert (tests["passed"], tests["failed"], tests["missing"]) == (2, 1, ["missing_test.py"])
    # junit's classname is the module's dotted path from pytest's rootdir, which depends on where tmp_path is.
    [failed_test] = tests["failed_tests"]
    assert failed_test == "test_kernels::test_broken" or failed_test.endswith(".test_kernels::test_broken")
    check = phases["backend_check"]["result"]
    assert check["identical_outputs"] == check["num_prompts"] == 2 and check["max_abs_logprob_diff_prompt"] == 0.0

    engine_random, sharegpt = phases["engine.random"]["result"], phases["datasets.sharegpt"]["result"]
    assert engine_random["complete"] and engine_random["output_tokens"] == 4 * 8
    assert phases["engine.sharegpt"]["result"]["output_tokens"] == sharegpt["total_output_tokens"]
    assert sharegpt["tokenizer"]["stand_in"] and sharegpt["loaded_from"] == requests_file
    hf_random = phases["hf.random"]["result"]
    assert hf_random["num_requests"] == 2 and hf_random["output_tokens"] == 2 * 8 and hf_random["sorted_by_length"]
    for name in ("batch1_decode", "random", "sharegpt"):
        ours, hf = phases[f"engine.{name}"]["result"], phases[f"hf.{name}"]["result"]
        assert payload["ratios_vs_hf"][name] == pytest.approx(ours["output_tokens_per_s"] / hf["output_tokens_per_s"])
        for result in (ours, hf):
            assert math.isfinite(result["floor"]["fraction_of_floor"]) and result["floor"]["fraction_of_floor"] > 0
    assert "first 2 requests" in payload["notes"]["hf_subset"]
    lines = out.rstrip().splitlines()
    assert lines[-1].split()[:2] == ["hf", "sharegpt"]  # the table is the last thing printed
    assert any(line.split()[:2] == ["pagellm", "random"] for line in lines)
