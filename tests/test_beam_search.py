"""Beam search equals Hugging Face `generate(num_beams=4, do_sample=False)` token for token."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM
from pagellm.entrypoints.beam_search import BeamSearchParams

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three colors."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=128 << 20, max_model_len=1024)


@pytest.mark.slow
def test_beam_search_matches_hf(llm, hf_smollm2_model):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                              BeamSearchParams(beam_width=4, max_tokens=MAX_TOKENS))
    for ids, out in zip(prompts, outputs):
        reference = hf_smollm2_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), num_beams=4,
            do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        best = out.sequences[0]
        assert best.tokens[len(ids):] == reference
        assert len(out.sequences) == 4
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        assert best.text == tok.decode(best.tokens)
    core = llm.llm_engine.engine_core
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks
    # The beams' shared prompt came from the prefix cache after the first step.
    assert llm.llm_engine.get_stats().prefix_cache_hits > 0


@pytest.mark.slow
def test_beam_width_one_is_greedy(llm):
    prompt = llm.get_tokenizer().encode("The three primary colors are")
    from pagellm import SamplingParams

    greedy = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    beam = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    assert beam[0].sequences[0].tokens[len(prompt):] == greedy[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, field", [(dict(beam_width=0, max_tokens=4), "beam_width"),
                                           (dict(beam_width=2, max_tokens=0), "max_tokens")])
def test_invalid_beam_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)
