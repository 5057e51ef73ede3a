"""benchmarks/host_step_bench.py times the engine's host phases around a stub forward."""
from __future__ import annotations

from benchmarks.host_step_bench import PHASES, host_step_ms, stub_engine


def test_times_decode_steps_of_every_request_by_phase():
    llm, clock = stub_engine(max_num_seqs=4, max_model_len=64)
    # host_step_ms raises if a timed step is not exactly one decode token per request.
    found = host_step_ms(llm, clock, batch=3, context_len=20, steps=4)
    assert all(found[name] > 0 for name in ("step", *PHASES))
    assert found["step"] >= max(found[name] for name in PHASES)
    assert not llm.llm_engine.has_unfinished_requests()
