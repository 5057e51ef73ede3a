"""logprobs / prompt_logprobs against Hugging Face's log_softmax on SmolLM2 (fp32, CPU): values,
top-k ids (ties allowed), ranks, cumulative logprob, across chunked prefill and prefix caching."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.outputs import Logprob

TOL = 1e-3
PROMPT = ("In the quiet town by the river, the baker wakes before dawn, lights the old oven, and "
          "shapes the first loaves while the streets are still empty. Later that morning")


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    # A 16-token budget splits the ~35-token prompt over several prefill chunks.
    return LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", kv_cache_memory_bytes=64 << 20, max_model_len=512,
               max_num_batched_tokens=16, max_num_seqs=4)


def hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row i is the distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def check_position(entry: dict[int, Logprob], token: int, ref: torch.Tensor, k: int) -> None:
    """One position's dict: the actual token with its true logprob and rank, plus HF's top k
    (up to ties), the actual token not repeated."""
    own = entry[token]
    num_higher = int((ref > ref[token] + TOL).sum()), int((ref > ref[token] - TOL).sum())
    assert num_higher[0] + 1 <= own.rank <= num_higher[1] + 1, (own.rank, num_higher)
    for t, lp in entry.items():
        assert abs(lp.logprob - ref[t].item()) < TOL
    others = [t for t in entry if t != token]
    assert len(others) == (k - 1 if own.rank <= k and k else k)
    if k:
        kth = ref.topk(k).values[-1].item()
        assert all(ref[t].item() >= kth - TOL for t in others)
        assert {entry[t].rank for t in others} <= set(range(1, k + 1))


@pytest.mark.slow
def test_logprobs_and_prompt_logprobs_match_hf(llm, hf_smollm2_model):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    assert len(prompt_ids) > 32
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    generated = completion.token_ids
    ref = hf_logprobs(hf_smollm2_model, prompt_ids + generated)

    assert len(out.prompt_logprobs) == len(prompt_ids) and out.prompt_logprobs[0] is None
    for i in range(1, len(prompt_ids)):
        check_position(out.prompt_logprobs[i], prompt_ids[i], ref[i - 1], 3)

    assert len(completion.logprobs) == len(generated)
    for j, token in enumerate(generated):
        entry = completion.logprobs[j]
        check_position(entry, token, ref[len(prompt_ids) - 1 + j], 5)
        assert next(iter(entry)) == token  # the sampled token comes first, as in vLLM
        assert entry[token].rank == 1 or abs(ref[len(prompt_ids) - 1 + j].max() - entry[token].logprob) < TOL
        assert entry[token].decoded_token == llm.get_tokenizer().decode([token], skip_special_tokens=False)
    expected_sum = sum(completion.logprobs[j][t].logprob for j, t in enumerate(generated))
    assert completion.cumulative_logprob == pytest.approx(expected_sum)
    assert abs(completion.cumulative_logprob - sum(ref[len(prompt_ids) - 1 + j, t].item()
                                                     for j, t in enumerate(generated))) < 8 * TOL


@pytest.mark.slow
def test_logprobs_are_of_the_raw_distribution_whatever_the_sampling(llm, hf_smollm2_model):
    prompt_ids = llm.get_tokenizer().encode("The capital of France is")
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=6, logprobs=0, repetition_penalty=1.5,
                            logit_bias={30: 5.0}, ignore_eos=True)
    completion = llm.generate({"prompt_token_ids": prompt_ids}, params, use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(hf_smollm2_model, prompt_ids + completion.token_ids)
    for j, token in enumerate(completion.token_ids):
        assert list(completion.logprobs[j]) == [token]  # logprobs=0: only the sampled token
        check_position(completion.logprobs[j], token, ref[len(prompt_ids) - 1 + j], 0)


@pytest.mark.slow
def test_prompt_logprobs_skip_prefix_cache_hits(llm):
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    warm = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    again = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and warm.prompt_logprobs is None
    scored = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=2, prompt_logprobs=0),
                          use_tqdm=False)[0]
    assert scored.num_cached_tokens == 0
    assert len(scored.prompt_logprobs) == len(prompt_ids)
    assert all(list(d) == [t] for d, t in zip(scored.prompt_logprobs[1:], prompt_ids[1:]))
    assert scored.outputs[0].logprobs is None and scored.outputs[0].cumulative_logprob is None


@pytest.mark.slow
def test_a_one_token_prompt_has_only_none(llm):
    out = llm.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.slow
def test_max_logprobs_is_enforced(llm):
    with pytest.raises(ValueError, match="prompt_logprobs must be at most 20"):
        llm.generate("Hi", SamplingParams(prompt_logprobs=21), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be at most 20"):
        llm.generate("Hi", SamplingParams(logprobs=50), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineArgs(max_logprobs=-1).validate()


def test_logprobs_and_bad_words_cross_the_process_boundary():
    """The engine core's outputs and the API side's bad-word ids survive msgspec (AsyncLLM's wire)."""
    from pagellm.core.outputs import EngineCoreOutput, SchedulerStats, TokenLogprobs
    from pagellm.core.request import EngineCoreRequest
    from pagellm.engine.wire import CoreOutputs, encoder, input_decoder, output_decoder

    rows = TokenLogprobs([[5, 5, 9]], [[-0.5, -0.5, -1.25]], [1])
    sent = CoreOutputs([EngineCoreOutput("a", [5], new_logprobs=rows, new_prompt_logprobs=rows)], SchedulerStats())
    assert output_decoder.decode(encoder.encode(sent)) == sent
    params = SamplingParams(bad_words=["x"], _bad_words_token_ids=[[3, 4]])
    received = input_decoder.decode(encoder.encode(EngineCoreRequest(
        request_id="r", prompt_token_ids=[1], sampling_params=params, eos_token_ids=frozenset({2}), max_tokens=5)))
    assert received.sampling_params._bad_words_token_ids == [[3, 4]]
