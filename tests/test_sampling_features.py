"""Penalties, logit bias, allowed tokens, bad words and min_tokens: their formulas on hand-built
logits, and their effect end to end on SmolLM2 (repetition penalty against Hugging Face)."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.core.request import EngineCoreRequest, Request
from pagellm.sample.logits_processors import LogitsProcessors
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import sample

CPU = torch.device("cpu")
VOCAB = 8
EOS = 7


def processed(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
              num_prompt: list[int]) -> torch.Tensor:
    procs = LogitsProcessors.build(params, token_ids, num_prompt, [[EOS]] * len(params), VOCAB, CPU)
    return procs.apply(logits.clone())


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.linspace(-1.0, 2.0, VOCAB).repeat(2, 1)
    tokens = [[1, 1, 2, 3, 3, 3], [4, 5]]  # prompt [1, 1] then output [2, 3, 3, 3]; row 1 unpenalized
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(logit_bias={0: 0.0})]
    out = processed(logits, params, tokens, [2, 2])
    expected = logits[0].clone()
    expected[2] -= 0.5 + 0.25 * 1
    expected[3] -= 0.5 + 0.25 * 3
    torch.testing.assert_close(out[0], expected)  # token 1 appears only in the prompt: untouched
    torch.testing.assert_close(out[1], logits[1])


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 0.0, 3.0, 1.5]])
    out = processed(logits, [SamplingParams(repetition_penalty=2.0)], [[0, 1, 2, 3]], [2])
    expected = torch.tensor([[1.0, -4.0, 0.5, -2.0, 0.5, 0.0, 3.0, 1.5]])
    torch.testing.assert_close(out, expected)


def test_logit_bias_and_allowed_token_ids():
    logits = torch.zeros(3, VOCAB)
    params = [SamplingParams(logit_bias={2: 5.0, 6: -3.0}), SamplingParams(allowed_token_ids=[1, 4]),
              SamplingParams(temperature=0.0)]
    out = processed(logits, params, [[0], [0], [0]], [1, 1, 1])
    assert out[0].tolist() == [0, 0, 5.0, 0, 0, 0, -3.0, 0]
    assert torch.isfinite(out[1]).tolist() == [i in (1, 4) for i in range(VOCAB)]
    assert out[2].tolist() == [0.0] * VOCAB


def test_bad_words_ban_the_last_token_after_its_prefix_and_min_tokens_bans_stops():
    logits = torch.zeros(3, VOCAB)
    words = SamplingParams(_bad_words_token_ids=[[5], [2, 3, 4]])
    short = SamplingParams(min_tokens=3, stop_token_ids=[6])
    params = [words, words, short]
    # Row 0's output ends with [2, 3]: 4 goes; row 1's prompt ends with it, which does not count.
    out = processed(logits, params, [[9, 2, 3], [2, 3], [9, 1, 1]], [1, 2, 1])
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [4, 5]
    assert torch.isinf(out[1]).nonzero().flatten().tolist() == [5]
    assert torch.isinf(out[2]).nonzero().flatten().tolist() == [6, EOS]  # 2 of 3 generated
    done = processed(logits, [short], [[9, 1, 1, 1]], [1])
    assert torch.isfinite(done).all()


def test_features_apply_to_greedy_rows_and_a_batch_without_them_builds_nothing():
    assert LogitsProcessors.build([SamplingParams(temperature=0.0)], [[1]], [1], [[EOS]], VOCAB, CPU) is None
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(2, 1)  # argmax 7 (EOS)
    params = [SamplingParams(temperature=0.0, min_tokens=1).apply_model_defaults({}),
              SamplingParams(temperature=0.0, logit_bias={3: 100.0}).apply_model_defaults({})]
    procs = LogitsProcessors.build(params, [[1], [1]], [1, 1], [[EOS]] * 2, VOCAB, CPU)
    md = SamplingMetadata.build(params, [0, 0], VOCAB, CPU, processors=procs)
    assert sample(logits, md).tolist() == [6, 3]


def test_check_stop_waits_for_min_tokens():
    request = Request.from_record(EngineCoreRequest(
        request_id="r", prompt_token_ids=[1, 2], sampling_params=SamplingParams(min_tokens=2, stop_token_ids=[5]),
        eos_token_ids=frozenset({EOS}), max_tokens=10))
    request.all_token_ids.append(EOS)
    assert not request.check_stop(EOS, 100)
    request.all_token_ids.append(5)
    assert request.check_stop(5, 100) and request.stop_reason == 5  # the 2nd token may stop


# -- end to end on SmolLM2 -----------------------------------------------------------------------

PROMPTS = ["The capital of France is", "Once upon a time, in a small village, there lived"]


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", kv_cache_memory_bytes=64 << 20, max_model_len=1024)


def greedy(**kwargs) -> SamplingParams:
    """Greedy, 24 tokens, unless the caller says otherwise."""
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 24, **kwargs})


def tokens_of(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_repetition_penalty_matches_hf_generate(llm, hf_smollm2_model):
    tok = llm.get_tokenizer()
    ours = tokens_of(llm, PROMPTS, greedy(repetition_penalty=1.3, ignore_eos=True))
    for prompt, got in zip(PROMPTS, ours):
        ids = torch.tensor([tok.encode(prompt)])
        ref = hf_smollm2_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                        repetition_penalty=1.3, pad_token_id=2)
        assert got == ref[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_bad_words_are_never_generated(llm):
    tok = llm.get_tokenizer()
    plain = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)[0].outputs[0]
    assert "Paris" in plain.text
    banned = llm.generate(PROMPTS[0], greedy(bad_words=["Paris"]), use_tqdm=False)[0].outputs[0]
    assert "Paris" not in banned.text
    assert not set(tok.encode(" Paris") + tok.encode("Paris")) & set(banned.token_ids)


@pytest.mark.slow
def test_min_tokens_keeps_an_early_ending_going(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    eos = llm.get_tokenizer().eos_token_id
    short = llm.chat(chat, greedy(max_tokens=200), use_tqdm=False)[0].outputs[0]
    n = len(short.token_ids)
    assert short.token_ids[-1] == eos and short.finish_reason == "stop"
    longer = llm.chat(chat, greedy(max_tokens=200, min_tokens=n + 4), use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) > n + 4
    assert eos not in longer.token_ids[:n + 4]
    assert longer.token_ids[:n - 1] == short.token_ids[:n - 1]


@pytest.mark.slow
def test_unfeatured_rows_are_unchanged_by_featured_neighbours(llm):
    plain = [greedy(), greedy(temperature=0.8, seed=7)]
    alone = tokens_of(llm, PROMPTS, plain)
    featured = greedy(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={11: 4.0},
                      bad_words=["Paris"], min_tokens=10, allowed_token_ids=list(range(3000)))
    mixed = tokens_of(llm, [PROMPTS[0], PROMPTS[1], PROMPTS[0]], [plain[0], plain[1], featured])
    assert mixed[:2] == alone
    assert mixed[2] != alone[0] and all(t < 3000 for t in mixed[2])
