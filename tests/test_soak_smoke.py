"""`benchmarks/soak.py` for a few seconds, so the script cannot rot: it starts a server, drives the
whole request mix with a few cut streams, and its JSON shows no error and no leaked KV block."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a server of the real model (benchmarks/soak.py starts it)

REPO_ROOT = Path(__file__).resolve().parent.parent
NUM_CUTS = 6
RUN_TIMEOUT_S = 300


def test_short_soak_has_no_errors_and_no_leaks(smollm2_path, tmp_path):
    output = tmp_path / "soak.json"
    command = [sys.executable, "-m", "benchmarks.soak", "--model", smollm2_path, "--device", "cpu",
               "--dtype", "float32", "--duration-s", "10", "--concurrency", "4", "--num-aborts", str(NUM_CUTS),
               "--invalid-fraction", "0.2", "--num-gpu-blocks-override", "96", "--max-model-len", "512",
               "--warmup-s", "5", "--rss-interval-s", "1", "--output", str(output)]
    run = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert output.exists(), f"no result written (exit code {run.returncode}):\n{run.stdout}\n{run.stderr[-4000:]}"
    report = json.loads(output.read_text())

    assert report["num_errors"] == 0, report["error_samples"]
    assert report["server_log_errors"] == [] and report["server_exit_code"] == 0
    assert report["idle"] == {"reached": True, "running": 0, "waiting": 0, "kv_cache_usage": 0, "leaked_blocks": 0}
    assert report["num_cuts"] == NUM_CUTS
    assert report["server_aborts"] == report["outcomes"].get("cut", 0)
    assert report["outcomes"]["ok"] > 0 and report["outcomes"]["rejected_as_expected"] > 0
    assert report["rss"]["start_mib"] > 100  # the model alone is bigger: the engine core was counted
    assert report["git"]["commit"] and report["hardware"]["logical_cores"]
