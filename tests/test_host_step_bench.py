"""benchmarks/host_step_bench.py runs the host side of decode steps without a model."""
from __future__ import annotations

import torch

from benchmarks.host_step_bench import host_step_ms


def test_times_every_decode_step_after_the_prefill():
    # 3 requests of 40 tokens: one prefill step, then 5 timed decode steps of 3 tokens each.
    # host_step_ms raises if a timed step is not exactly one decode token per request.
    times = host_step_ms(batch=3, context_len=40, steps=5, device=torch.device("cpu"))
    assert len(times) == 5 and all(t > 0 for t in times)
