"""n > 1: child requests that share the prompt's KV blocks, seeded per child, gathered into one output,
aborted together; offline (LLM, LLMEngine) and through AsyncLLM."""
from __future__ import annotations

import asyncio

import pytest

from pagellm import LLM, EngineArgs, LLMEngine, SamplingParams
from pagellm.engine.async_llm import AsyncLLM
from pagellm.sampling_params import RequestOutputKind
from engine_utils import assert_no_leak, wait_for

pytestmark = pytest.mark.slow  # engines on the real model

SMALL_KV = 64 << 20
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024)


def used_blocks(engine: LLMEngine) -> int:
    core = engine.engine_core
    return core.num_blocks - core.scheduler.kv.pool.num_free_blocks


def test_n8_seeded_outputs_are_indexed_reproducible_and_share_the_prompt_blocks(llm):
    engine = llm.llm_engine
    prompt_ids = llm.get_tokenizer().encode("Write a short poem about the sea and the sky, " * 4)[:40]
    num_full_blocks = len(prompt_ids) // BLOCK_SIZE
    assert num_full_blocks == 2 and len(prompt_ids) % BLOCK_SIZE  # 2 full blocks + a partial one
    params = SamplingParams(n=8, temperature=1.0, seed=42, max_tokens=6, ignore_eos=True)

    engine.add_request("poem", {"prompt_token_ids": prompt_ids}, params)
    engine.step()
    # The prompt's full blocks once; each child its own partial block (which its first token fits in).
    assert used_blocks(engine) == num_full_blocks + 8
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "poem" and [c.index for c in out.outputs] == list(range(8))
            final = out
    assert final.finished and all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in final.outputs)
    assert_no_leak(engine)

    again = llm.generate([prompt_ids], params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in final.outputs]
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1  # children sample independently
    # Child i is the request with seed + i.
    third = llm.generate([prompt_ids], SamplingParams(temperature=1.0, seed=45, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0]
    assert third.outputs[0].token_ids == final.outputs[3].token_ids
    assert_no_leak(engine)


def test_delta_outputs_of_children_concatenate_per_index(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    reference = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    engine.add_request("d", "Once upon a time", SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
    texts, tokens = ["", "", ""], [[], [], []]
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                texts[c.index] += c.text
                tokens[c.index] += c.token_ids
    assert tokens == [c.token_ids for c in reference.outputs]
    assert texts == [c.text for c in reference.outputs]
    assert_no_leak(engine)


def test_aborting_the_parent_aborts_every_child(llm):
    engine = llm.llm_engine
    engine.add_request("many", "Tell me a story", SamplingParams(n=4, temperature=1.0, max_tokens=50, ignore_eos=True))
    engine.add_request("other", "Hello", SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.get_num_unfinished_requests() == 5
    aborted = engine.abort_request("many")
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].request_id == "many"
    assert [c.finish_reason for c in aborted[0].outputs] == ["abort"] * 4
    assert all(len(c.token_ids) == 3 for c in aborted[0].outputs)
    assert engine.get_num_unfinished_requests() == 1
    while engine.has_unfinished_requests():
        assert all(out.request_id == "other" for out in engine.step())
    assert_no_leak(engine)


def test_generate_and_chat_with_n_and_stop_strings(llm):
    chat = [{"role": "user", "content": "Name a colour."}]
    out = llm.chat(chat, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=30), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1] and all(c.finish_reason for c in out.outputs)
    outs = llm.generate(["Count: one, two, three,", "Hi"], [
        SamplingParams(n=3, temperature=0.0, max_tokens=20, ignore_eos=True, stop=["six"]),
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)], use_tqdm=False)
    assert all(c.text == " four, five, " and c.stop_reason == "six" for c in outs[0].outputs)
    assert len(outs[1].outputs) == 1
    assert_no_leak(llm.llm_engine)


def test_best_of_returns_the_n_most_likely_of_its_samples(llm):
    common = dict(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    # The same children, all returned with their logprobs (child i has seed 3 + i either way).
    every = llm.generate("The sea is", SamplingParams(n=4, logprobs=0, **common), use_tqdm=False)[0].outputs
    best = llm.generate("The sea is", SamplingParams(n=2, best_of=4, **common), use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: c.cumulative_logprob, reverse=True)[:2]
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked])
    assert all(c.logprobs is None for c in best)  # not asked for
    assert_no_leak(llm.llm_engine)


def test_duplicate_parent_id_is_refused_before_anything_is_queued(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, max_tokens=2)
    engine.add_request("dup", "Hi", params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "Hi", params)
    assert engine.get_num_unfinished_requests() == 2
    engine.abort_request("dup")
    assert_no_leak(engine)


# -- AsyncLLM --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def async_llm(smollm2_path):
    engine = AsyncLLM.from_engine_args(EngineArgs(
        smollm2_path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=SMALL_KV,
        max_model_len=1024))
    yield engine
    engine.shutdown()


def test_async_n_stop_string_and_abort(async_llm, llm):
    seeded = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    stop = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=["six"],
                          output_kind=RequestOutputKind.FINAL_ONLY)
    long = SamplingParams(n=3, temperature=1.0, max_tokens=900, ignore_eos=True)

    async def run():
        parallel = [o async for o in async_llm.generate("The sea is", seeded, "par")]
        stopped = [o async for o in async_llm.generate("Count: one, two, three,", stop, "stop")]
        # The stop string ended the request in the core too: nothing runs, no block is held.
        await wait_for(lambda: async_llm.get_stats().num_running_reqs == 0
                       and async_llm.get_stats().kv_cache_usage == 0)
        seen = []
        async for out in async_llm.generate("A long story:", long, "long"):
            seen.append(out)
            if len(seen) == 2:
                await async_llm.abort("long")
        await wait_for(lambda: async_llm.get_stats().num_running_reqs == 0
                       and async_llm.get_stats().kv_cache_usage == 0)
        return parallel, stopped, seen

    parallel, stopped, seen = asyncio.run(run())
    offline = llm.generate("The sea is", seeded, use_tqdm=False)[0]
    assert parallel[-1].finished and not any(o.finished for o in parallel[:-1])
    assert [c.token_ids for c in parallel[-1].outputs] == [c.token_ids for c in offline.outputs]
    assert len(stopped) == 1 and stopped[0].outputs[0].text == " four, five, "
    assert stopped[0].outputs[0].finish_reason == "stop" and stopped[0].outputs[0].stop_reason == "six"
    assert seen[-1].finished and [c.finish_reason for c in seen[-1].outputs] == ["abort"] * 3
