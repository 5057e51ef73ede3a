"""Async scheduling (step N+1 scheduled and launched before step N's tokens are read) gives exactly
the outputs of one-step-at-a-time execution, whatever the scheduling: preemption, chunked prefill,
logprobs, seeded sampling with n > 1, stop conditions, aborts.

On the CPU nothing runs asynchronously, but the bookkeeping is the same: placeholders in the
scheduler, decode inputs taken from the previous step's device tensor of sampled ids.
"""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from engine_utils import assert_no_leak

pytestmark = pytest.mark.slow  # engines on the real model

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "List three prime numbers larger than 50:",
    "Once upon a time, in a small village by the sea,",
]
VARIANTS = {
    "default": {},
    "preemption": dict(num_gpu_blocks_override=4, max_model_len=64),
    "chunked prefill": dict(max_num_batched_tokens=8, max_num_seqs=4),
}


SMALL_KV = 32 << 20  # float32: 45 blocks of 16 tokens, plenty for these prompts


def make_llm(smollm2_path: str, overlap: bool, **kwargs) -> LLM:
    kwargs = {"kv_cache_memory_bytes": SMALL_KV, "max_model_len": 512, **kwargs}
    return LLM(smollm2_path, dtype="float32", device="cpu", async_scheduling=overlap, **kwargs)


def run(smollm2_path: str, overlap: bool, params: SamplingParams, **kwargs) -> tuple[list, LLM]:
    llm = make_llm(smollm2_path, overlap, **kwargs)
    return llm.generate(PROMPTS, params, use_tqdm=False), llm


def assert_same_outputs(got, expected) -> None:
    """Same tokens, texts and finish reasons; logprobs (same token ids) within 1e-4: rows that run
    one step longer under overlap change the batch's shape and so the last bits of the matmuls."""
    for out, ref in zip(got, expected, strict=True):
        for c, r in zip(out.outputs, ref.outputs, strict=True):
            assert (c.token_ids, c.finish_reason, c.text) == (r.token_ids, r.finish_reason, r.text)
            for step, ref_step in zip(c.logprobs or [], r.logprobs or [], strict=True):
                assert step.keys() == ref_step.keys()
                assert all(abs(step[t].logprob - ref_step[t].logprob) < 1e-4 for t in step)


@pytest.mark.parametrize("variant", VARIANTS)
def test_overlap_gives_the_same_greedy_outputs(smollm2_path: str, variant: str) -> None:
    # A stop string ends some requests after a few tokens: only the default variant uses one, so
    # the others keep enough requests growing to preempt each other.
    stop = ["\n\n"] if variant == "default" else None
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, stop=stop)
    expected, _ = run(smollm2_path, False, params, **VARIANTS[variant])
    got, llm = run(smollm2_path, True, params, **VARIANTS[variant])
    assert llm.llm_engine.engine_core.overlap
    assert_same_outputs(got, expected)
    if variant == "preemption":
        assert llm.llm_engine.get_stats().num_preemptions > 0
    assert_no_leak(llm.llm_engine)


def test_overlap_gives_the_same_seeded_samples_and_prompt_logprobs(smollm2_path: str) -> None:
    params = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=7, max_tokens=16, prompt_logprobs=1)
    expected, _ = run(smollm2_path, False, params)
    got, llm = run(smollm2_path, True, params)
    assert_same_outputs(got, expected)
    for out, ref in zip(got, expected):
        assert [sorted(p) if p else p for p in out.prompt_logprobs] == \
            [sorted(p) if p else p for p in ref.prompt_logprobs]
    assert_no_leak(llm.llm_engine)


def test_penalties_turn_overlap_off_and_match(smollm2_path: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, repetition_penalty=1.3, min_tokens=4)
    expected, _ = run(smollm2_path, False, params)
    got, llm = run(smollm2_path, True, params)
    assert_same_outputs(got, expected)
    assert llm.llm_engine.engine_core.scheduler.can_overlap  # all finished: overlap allowed again
    assert_no_leak(llm.llm_engine)


def test_abort_while_a_step_is_in_flight(smollm2_path: str) -> None:
    engine = make_llm(smollm2_path, True).llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    for _ in range(4):
        engine.step()
    assert engine.engine_core._in_flight
    engine.abort_request(["0", "3"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert {"0", "3"}.isdisjoint(finished) and len(finished) == len(PROMPTS) - 2
    assert all(len(o.outputs[0].token_ids) == 32 or o.outputs[0].finish_reason == "stop" for o in finished.values())
    assert_no_leak(engine)
