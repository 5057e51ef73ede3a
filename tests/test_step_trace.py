"""benchmarks/step_trace: each step's composition, grouped and set against its serial floor (CPU path)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

# `benchmarks` is a folder of the repository, not part of the installed package.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import step_trace  # noqa: E402
from pagellm.benchmarks.roofline import sum_range  # noqa: E402
from test_bench_cli import TINY_LLAMA  # noqa: E402


def test_trace_accounts_for_every_token_and_key(tmp_path, monkeypatch):
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA))
    monkeypatch.setattr(step_trace, "default_result_path", lambda name: tmp_path / f"{name}.json")
    # 6 prompts of 40 tokens, 12 tokens each, at most 4 at once: the last two wait for the first to
    # finish, and their prompts then share steps with the others' decodes.
    payload = step_trace.main(["--model", str(model), "--device", "cpu", "--random", "40", "12",
                               "--num-prompts", "6", "--max-num-seqs", "4", "--max-model-len", "256"])
    steps = payload["steps"]
    prompt, output, n = 40, 12, 6
    assert sum(s["prompt_tokens"] for s in steps) == n * prompt
    assert sum(s["decodes"] for s in steps) == n * (output - 1)
    assert sum(s["sampled"] for s in steps) == n * output
    # Decode j (1-based) of a request attends to prompt + j keys; a prompt's pairs are its triangle.
    assert sum(s["kv_tokens"] for s in steps) == n * sum_range(prompt + 1, prompt + output - 1)
    assert sum(s["prompt_pairs"] for s in steps) == n * sum_range(1, prompt)
    assert all(s["decodes"] <= 4 for s in steps)
    assert [s["done_s"] for s in steps] == sorted(s["done_s"] for s in steps)
    groups = {g["group"]: g for g in payload["groups"]}
    assert sum(g["steps"] for g in groups.values()) == len(steps) == payload["throughput"]["num_steps"]
    assert groups["prompt chunks"]["prompt_tokens"] == n * prompt
    assert set(groups) <= {"prompt chunks", "decode 1-1", "decode 2-2", "decode 3-8"}
    assert all(g["taken_s"] > 0 and g["serial_floor_s"] > 0 for g in groups.values())
