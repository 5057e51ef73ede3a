"""The HF baseline's batching: sorted by length, batch size halved on GPU out-of-memory, outputs in input order."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# `benchmarks` is a folder of the repository, not part of the installed package.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks.hf_baseline import run_hf_generate, run_hf_largest_batch  # noqa: E402
from pagellm.benchmarks.datasets import BenchRequest  # noqa: E402


class FakeHF:
    """`generate` that runs out of memory above `max_rows` and answers each row with its last prompt token."""

    device = torch.device("cpu")
    generation_config = SimpleNamespace(pad_token_id=0, eos_token_id=2)
    config = SimpleNamespace(pad_token_id=0)

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.calls: list[tuple[int, int, int]] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        rows, width = input_ids.shape
        self.calls.append((rows, width, max_new_tokens))
        if rows > self.max_rows:
            raise torch.cuda.OutOfMemoryError("fake: batch too large")
        assert kwargs["min_new_tokens"] == max_new_tokens and not kwargs["do_sample"]
        assert (attention_mask.sum(1) > 0).all()
        return torch.cat([input_ids, input_ids[:, -1:].expand(rows, max_new_tokens)], dim=1)


REQUESTS = [BenchRequest([100 + i] * (3 + i % 4), output_len=2 + (i * 5) % 7) for i in range(11)]


def test_largest_batch_halves_on_oom_and_sorts_by_length():
    model = FakeHF(max_rows=3)
    result = run_hf_largest_batch(model, REQUESTS, max_batch_size=16)
    assert result.oom_batch_sizes == [11, 5] and result.batch_size == 2
    assert result.sorted_by_length
    completed = [c for c in model.calls if c[0] <= 3]
    assert [c[0] for c in completed] == [2] * 5 + [1]
    # Longest outputs first, so batches hold similar lengths and the first one is the largest.
    new_tokens = [c[2] for c in completed]
    assert new_tokens == sorted(new_tokens, reverse=True) and new_tokens[0] == max(r.output_len for r in REQUESTS)
    # Outputs come back in input order, each cut to its own length.
    assert result.output_token_ids == [[r.prompt_token_ids[-1]] * r.output_len for r in REQUESTS]
    assert result.output_tokens == sum(r.output_len for r in REQUESTS)
    assert result.generated_tokens == sum(rows * new for rows, _, new in completed) > result.output_tokens
    assert result.summary()["oom_batch_sizes"] == [11, 5]


def test_input_order_batches_and_oom_without_halving():
    model = FakeHF(max_rows=4)
    result = run_hf_generate(model, REQUESTS, batch_size=4)
    assert [c[0] for c in model.calls] == [4, 4, 3] and not result.sorted_by_length
    assert result.output_token_ids == [[r.prompt_token_ids[-1]] * r.output_len for r in REQUESTS]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        run_hf_generate(FakeHF(max_rows=2), REQUESTS, batch_size=4)
