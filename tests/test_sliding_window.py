"""Mistral with its sliding window against Hugging Face `transformers`: a tiny random model built from
`MistralConfig` with a window shorter than every prompt, saved as safetensors. Greedy tokens and
logprobs through the engine (both CPU attention backends, chunked prefill, prefix caching,
preemption, n-gram speculation; TP=2 and PP=2 over processes), the blocks a long sequence holds as it
grows, and draft-model speculation refused."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import transformers
from engine_utils import assert_no_leak
from family_utils import assert_matches_hf, assert_prefix_hits_keep_the_tokens, save_with_tokenizer

from pagellm import LLM, SamplingParams
from pagellm.core.kv_cache_groups import window_blocks

# `benchmarks` is a folder of the repository, not part of the installed package.
_REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from benchmarks import window_kv  # noqa: E402

NEW_TOKENS = 32
VOCAB = 256
WINDOW = 12
"""Shorter than every prompt below: each of them attends past it (HF masks keys j <= p - 12)."""
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((17, 33, 40, 13))]
SHARED_PREFIX = [(11 * j) % 250 + 3 for j in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20, block_size=8)


def hf_mistral():
    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        sliding_window=WINDOW, bos_token_id=1, eos_token_id=2,
                                        tie_word_embeddings=False, architectures=["MistralForCausalLM"])
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, Hugging Face model) of the tiny Mistral."""
    folder = tmp_path_factory.mktemp("mistral")
    model = hf_mistral()
    save_with_tokenizer(model, folder)
    return folder, model


def prefix_prompts() -> list[list[int]]:
    return [SHARED_PREFIX + [5 + i, 9 + i] for i in range(3)]


def test_the_window_changes_hugging_faces_output(tiny):
    """The model is sensitive to its window: without it, HF's own greedy tokens differ."""
    _, model = tiny
    prompt = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        windowed = model(prompt).logits[0, -1]
        model.config.sliding_window = None
        try:
            full = model(prompt).logits[0, -1]
        finally:
            model.config.sliding_window = WINDOW
    assert not torch.allclose(windowed, full, atol=1e-3)


@pytest.mark.parametrize("variant", ["cpu", "torch", "chunked", "preempted", "ngram"])
def test_greedy_tokens_and_logprobs_match_hf(tiny, variant):
    folder, model = tiny
    kwargs = {"cpu": {},  # the C attention kernel
              "torch": {"attention_backend": "torch"},
              # Prompts split into chunks of at most 8 tokens a step, beside running decodes.
              "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
              # 8 blocks of 8 tokens for four sequences each holding up to 3 as they decode (a 16-token
              # prompt chunk up to 5): the latest admitted is preempted.
              "preempted": {"num_gpu_blocks_override": 8, "max_model_len": 96, "max_num_batched_tokens": 16,
                            "max_num_seqs": 4, "enable_prefix_caching": False},
              # Drafts verified, the rejected ones' KV rolled back within the window.
              "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_min": 1}},
              }[variant]
    llm = LLM(str(folder), **{**CPU, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_matches_hf(model, outs, PROMPTS, NEW_TOKENS)
    if variant == "preempted":
        assert llm.llm_engine.engine_core.stats().num_preemptions > 0
    assert_no_leak(llm.llm_engine)


def test_prefix_cache_hits_keep_the_tokens(tiny):
    folder, model = tiny
    assert_prefix_hits_keep_the_tokens(folder, model, prefix_prompts(), 2 * 40, GREEDY, NEW_TOKENS, **CPU)


def test_a_long_sequence_holds_only_its_windows_blocks(tiny):
    """Stepping one request: after its prompt, its blocks never exceed what the window reaches."""
    folder, _ = tiny
    llm = LLM(str(folder), **CPU)
    engine = llm.llm_engine
    kv = engine.engine_core.scheduler.kv
    assert kv.windows == (WINDOW,)
    engine.add_request("long", {"prompt_token_ids": PROMPTS[2]},
                       SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held += kv.num_blocks_held("long")
    # 40 prompt tokens in 5 blocks; then at most the blocks that 12 positions span.
    assert held[0] == 5 and max(held[1:]) == window_blocks(WINDOW, 8) == 3
    assert_no_leak(engine)


def test_a_draft_model_is_refused_for_windowed_layers(tiny):
    folder, _ = tiny
    with pytest.raises(ValueError, match="draft model keeps its KV cache in the target's blocks.*ngram"):
        LLM(str(folder), **CPU, speculative_config={"model": str(folder), "num_speculative_tokens": 2})


@pytest.mark.slow  # two rank processes (each starts Python and imports torch): tens of seconds
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_two_ranks_over_processes_match_hf(tiny, split):
    folder, model = tiny
    prompts = PROMPTS + prefix_prompts()
    llm = LLM(str(folder), **CPU, max_num_batched_tokens=32, max_num_seqs=4, **split)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert_matches_hf(model, outs, prompts, NEW_TOKENS)
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.slow  # `pagellm plan` in a subprocess, then an engine: some seconds
def test_window_benchmark_finds_plan_and_engine_at_the_window_arithmetic(tmp_path: Path) -> None:
    """Gemma-3's layer pattern at tiny sizes: one full group, five windowed ones; each group's blocks
    in the engine equal the plan's and the arithmetic's, and a windowed group holds fewer."""
    payload = window_kv.main(["--smoke", "--out-dir", str(tmp_path)])
    groups = payload["groups"]
    assert [g["sliding_window"] for g in groups] == [None] + [40] * 5
    assert payload["all_match"]
    assert all(g["engine_decode_most_blocks"] < groups[0]["engine_decode_most_blocks"] for g in groups[1:])
    assert len(list(tmp_path.glob("window_kv*.json"))) == 1
