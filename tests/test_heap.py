"""The engine core hands freed C-heap pages back to the OS every TRIM_INTERVAL_S (pagellm/engine/heap.py).

Whether that stops RSS from creeping is measured by the soak (benchmarks/soak.py), not here.
"""
from __future__ import annotations

import sys

import pytest

from pagellm import LLM, SamplingParams
from pagellm.engine import core as engine_core
from pagellm.engine.heap import HeapTrimmer


def test_trims_at_most_once_per_interval():
    now, calls = [100.0], []
    trimmer = HeapTrimmer(interval_s=10.0, clock=lambda: now[0], trim=lambda pad: calls.append(pad) or 1)
    assert not trimmer.maybe_trim()  # the interval counts from creation
    now[0] = 109.9
    assert not trimmer.maybe_trim()
    now[0] = 110.0
    assert trimmer.maybe_trim() and calls == [0]
    now[0] = 115.0
    assert not trimmer.maybe_trim()
    now[0] = 121.0
    assert trimmer.maybe_trim() and calls == [0, 0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_glibc_malloc_trim_is_found_and_runs():
    trimmer = HeapTrimmer(interval_s=0.0)
    assert trimmer.available
    assert trimmer.maybe_trim()


@pytest.mark.slow
def test_engine_steps_trim_the_heap(smollm2_path, monkeypatch):
    trims: list[int] = []

    class CountingTrimmer(HeapTrimmer):
        def __init__(self) -> None:
            super().__init__(interval_s=0.0, trim=lambda pad: trims.append(pad) or 1)

    monkeypatch.setattr(engine_core, "HeapTrimmer", CountingTrimmer)
    llm = LLM(smollm2_path, device="cpu", dtype="float32", num_gpu_blocks_override=64, max_model_len=256)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert len(trims) >= 4, "one chance to trim per engine step"
