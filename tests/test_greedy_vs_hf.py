"""Greedy generation on SmolLM2 equals Hugging Face transformers token for token (fp32, CPU),
whatever the scheduling: chunked prefill, preemption, prefix caching, block size, batching."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from engine_utils import assert_no_leak

pytestmark = pytest.mark.slow  # the real model against the Hugging Face reference

NUM_NEW_TOKENS = 48
TIE_GAP = 1e-4
LONG_SYSTEM = (
    "You are a meticulous assistant for a small public library. You answer briefly, you never invent "
    "facts, and when you are unsure you say so and suggest where the reader could look instead."
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about autumn leaves."}],
    [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Do you have books on gardening?"}],
    [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "When do you open on Sundays?"}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
    [{"role": "user", "content": "List three prime numbers larger than 50."}],
    [{"role": "system", "content": LONG_SYSTEM},
     {"role": "user", "content": "Can I renew a loan online? Please explain the steps one by one."}],
    [{"role": "user", "content": "Translate 'good morning, my friend' into Spanish and German."}],
]


@pytest.fixture(scope="module")
def prompt_ids(reference_llm: LLM) -> list[list[int]]:
    tok = reference_llm.get_tokenizer()
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in CONVERSATIONS]


@pytest.fixture(scope="module")
def reference_llm(smollm2_path: str) -> LLM:
    return LLM(smollm2_path, dtype="float32", quantization="none", device="cpu")


@pytest.fixture(scope="module")
def hf_reference(hf_smollm2_model, prompt_ids) -> list[tuple[list[int], list[float]]]:
    """Per prompt (no padding): HF's greedy tokens and the top-2 logit gap at each step."""
    refs = []
    for ids in prompt_ids:
        out = hf_smollm2_model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NUM_NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True, pad_token_id=2)
        tokens = out.sequences[0, len(ids):].tolist()
        gaps = []
        for step_logits in out.logits:
            top2 = step_logits[0].float().topk(2).values
            gaps.append(float(top2[0] - top2[1]))
        refs.append((tokens, gaps))
    return refs


def assert_matches_reference(outputs, hf_reference, label: str) -> None:
    """Tokens must equal HF's until HF stops; a divergence is tolerated only at a near-tie step."""
    for i, (out, (ref_tokens, gaps)) in enumerate(zip(outputs, hf_reference)):
        ours = out.outputs[0].token_ids
        for step, (a, b) in enumerate(zip(ours, ref_tokens)):
            if a != b:
                assert gaps[step] < TIE_GAP, (
                    f"[{label}] prompt {i} diverges at step {step}: ours {a}, HF {b}, HF top-2 gap {gaps[step]:.2e}")
                print(f"[{label}] prompt {i}: tolerated divergence at step {step} (HF top-2 gap {gaps[step]:.2e})")
                break
        else:
            # No divergence: we must have stopped exactly where HF did (EOS) or at the length cap.
            assert len(ours) == len(ref_tokens), f"[{label}] prompt {i}: {len(ours)} tokens vs HF {len(ref_tokens)}"


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS)
VARIANT_TOKENS = 32
"""The scheduling variants below run fewer tokens (CI time); the default engine checks all 48."""
VARIANT = SamplingParams(temperature=0.0, max_tokens=VARIANT_TOKENS)


def first_tokens(hf_reference, num_tokens: int, num_prompts: int | None = None):
    """HF's reference cut to its first `num_tokens` tokens (and `num_prompts` prompts)."""
    return [(tokens[:num_tokens], gaps[:num_tokens]) for tokens, gaps in hf_reference[:num_prompts]]


def test_default_engine_matches_hf(reference_llm, prompt_ids, hf_reference):
    outputs = reference_llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, hf_reference, "default")
    assert all(o.outputs[0].finish_reason in ("stop", "length") for o in outputs)
    assert_no_leak(reference_llm.llm_engine)
    # Shared system prompts (the template's default one, and LONG_SYSTEM) hit the prefix cache.
    stats = reference_llm.llm_engine.get_stats()
    assert stats.prefix_cache_hits > 0


def test_chat_api_matches_hf(reference_llm, hf_reference):
    outputs = reference_llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert_matches_reference(outputs, hf_reference, "chat")
    tok = reference_llm.get_tokenizer()
    for out in outputs:
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    assert_no_leak(reference_llm.llm_engine)


def test_requests_alone_match_hf(reference_llm, prompt_ids, hf_reference):
    # Four prompts, two of them with the long system prompt (a prefix-cache hit when alone).
    outputs = [reference_llm.generate([ids], VARIANT, use_tqdm=False)[0] for ids in prompt_ids[:4]]
    assert_matches_reference(outputs, first_tokens(hf_reference, VARIANT_TOKENS, 4), "alone")
    assert_no_leak(reference_llm.llm_engine)


@pytest.mark.parametrize("label, kwargs", [
    ("chunked prefill", dict(max_num_batched_tokens=16, max_num_seqs=8)),
    ("no prefix caching, block size 32", dict(enable_prefix_caching=False, block_size=32)),
])
def test_scheduling_variants_match_hf(smollm2_path, prompt_ids, hf_reference, label, kwargs):
    llm = LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", **kwargs)
    outputs = llm.generate(prompt_ids, VARIANT, use_tqdm=False)
    assert_matches_reference(outputs, first_tokens(hf_reference, VARIANT_TOKENS), label)
    assert_no_leak(llm.llm_engine)
    if not kwargs.get("enable_prefix_caching", True):
        assert llm.llm_engine.get_stats().prefix_cache_hits == 0


def test_preemption_matches_hf(smollm2_path, prompt_ids, hf_reference):
    # 20 blocks x 16 tokens: two or three of the eight requests fit at once, so the scheduler
    # must preempt and recompute.
    llm = LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", num_gpu_blocks_override=20, max_model_len=320)
    outputs = llm.generate(prompt_ids, VARIANT, use_tqdm=False)
    assert llm.llm_engine.get_stats().num_preemptions > 0
    assert_matches_reference(outputs, first_tokens(hf_reference, VARIANT_TOKENS), "preemption")
    assert_no_leak(llm.llm_engine)


def test_triton_attention_backend_matches_hf(smollm2_path, prompt_ids, hf_reference):
    # Under Triton's CPU interpreter here (slow: few prompts and tokens), on the GPU compiled.
    pytest.importorskip("triton")
    num_tokens, num_prompts = 3, 1
    llm = LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", attention_backend="triton")
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens)
    outputs = llm.generate(prompt_ids[:num_prompts], params, use_tqdm=False)
    assert_matches_reference(outputs, first_tokens(hf_reference, num_tokens, num_prompts), "triton backend")
    assert_no_leak(llm.llm_engine)


def test_gguf_blocks_kept_quantized_match_hf(smollm2_path, prompt_ids, hf_reference):
    """The CPU default: the GGUF's Q4_1/Q8_0 blocks multiplied as they are, in float32."""
    llm = LLM(smollm2_path, dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20, max_model_len=1024)
    assert llm.llm_engine.config.model.quantization == "gguf" and llm.llm_engine.config.model.attention_backend == "cpu"
    outputs = llm.generate(prompt_ids, VARIANT, use_tqdm=False)
    assert_matches_reference(outputs, first_tokens(hf_reference, VARIANT_TOKENS), "gguf blocks")
    assert_no_leak(llm.llm_engine)
