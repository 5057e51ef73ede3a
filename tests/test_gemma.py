"""Gemma 2 and Gemma 3 (text) against Hugging Face `transformers`: tiny random models built from
`Gemma2Config` and `Gemma3TextConfig` (sliding and full layers, the window shorter than every
prompt, soft caps small enough to matter, Gemma 3's two rotary bases), saved as safetensors. Greedy
tokens and logprobs through the engine (chunked prefill, prefix caching, preemption; TP=2 and PP=2
over processes), the blocks each KV cache group holds, and what is refused."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import transformers
from engine_utils import assert_no_leak
from family_utils import assert_matches_hf, assert_prefix_hits_keep_the_tokens, save_with_tokenizer

from pagellm import LLM, SamplingParams
from pagellm.attention import get_attn_backend
from pagellm.config.arch import ModelArchConfig
from pagellm.core.kv_cache_groups import window_blocks
from pagellm.eval.quality import bind_window_cache
from pagellm.models import get_model_class
from pagellm.models.cpu_layer import why_not_fused
from pagellm.worker.loading import prompt_hidden_states

NEW_TOKENS = 32
VOCAB = 256
WINDOW = 12
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    # Layers 0 and 2 windowed; scores capped at 2 and logits at 5 (Gemma 2's 50 and 30 barely act on
    # a random model's small scores).
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    # Layers 0, 1 and 3 windowed (pattern 3); local layers rotate with base 100, the full one with
    # 10000 scaled linearly by 2.
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        sliding_window_pattern=3, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})),
}
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((17, 33, 40, 13))]
SHARED_PREFIX = [(11 * j) % 250 + 3 for j in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20, block_size=8)


def hf_model(family: str):
    arch, config_cls, kwargs = FAMILIES[family]
    config = getattr(transformers, config_cls)(architectures=[arch], **COMMON, **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(sorted(FAMILIES).index(family))
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.1 if "norm" in name else 0.15)  # norms scale by 1 + weight
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    """(family, its folder, its Hugging Face model)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    save_with_tokenizer(model, folder)
    return request.param, folder, model


def prefix_prompts() -> list[list[int]]:
    return [SHARED_PREFIX + [5 + i, 9 + i] for i in range(3)]


def hf_variant(model, **changes):
    """`model`'s weights under its config with `changes`."""
    config = type(model.config)(**{**model.config.to_dict(), **changes})
    config._attn_implementation = "eager"
    variant = type(model)(config).eval()
    variant.load_state_dict(model.state_dict())
    return variant


DIFFERENCES = {
    "gemma2": [dict(sliding_window=1000), dict(attn_logit_softcapping=None), dict(final_logit_softcapping=None)],
    "gemma3": [dict(sliding_window=1000), dict(rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": FAMILIES["gemma3"][2]["rope_parameters"]["full_attention"]})],
}
"""Per family, config changes each of which changes the tiny model's output (so each part is tested)."""


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf_and_every_difference_from_llama_matters(family):
    hf = hf_model(family)
    config = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    model = get_model_class(config.architecture)(config, get_attn_backend("torch"))
    assert model.load_weights(hf.state_dict().items()) == {name for name, _ in model.named_parameters()}
    tokens = torch.tensor(PROMPTS[2])
    with torch.no_grad():
        reference = hf(tokens[None]).logits[0]
        torch.testing.assert_close(model.compute_logits(prompt_hidden_states(model, tokens.tolist())), reference,
                                   atol=1e-4, rtol=1e-4)
        for changes in DIFFERENCES[family]:
            assert not torch.allclose(hf_variant(hf, **changes)(tokens[None]).logits[0], reference, atol=1e-3), changes
    assert why_not_fused(model.decoder_layers()[0]) == "GemmaDecoderLayer is not a Llama decoder layer"


def test_a_bound_cache_of_four_groups_gives_the_same_hidden_states():
    """Bound to a KV cache (eval's: one window of blocks per group), each layer stores in its group's
    blocks, the full layer's in group 0, and the hidden states are those computed without a cache."""
    hf = hf_model("gemma3")
    config = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    model = get_model_class(config.architecture)(config, get_attn_backend("cpu"))
    model.load_weights(hf.state_dict().items())
    tokens = PROMPTS[2]
    without = prompt_hidden_states(model, tokens)
    bind_window_cache(model, 64, torch.float32, torch.device("cpu"))
    assert [a.kv_group for a in model.attention_layers()] == [1, 2, 0, 3]
    assert len({a.kv_cache[0].data_ptr() for a in model.attention_layers()}) == 1  # one slot: groups of one layer
    torch.testing.assert_close(prompt_hidden_states(model, tokens), without, atol=1e-5, rtol=1e-5)


def test_gemma3_layers_take_their_windows_and_rotary_bases():
    hf = hf_model("gemma3")
    config = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    model = get_model_class(config.architecture)(config, get_attn_backend("torch"))
    assert [a.sliding_window for a in model.attention_layers()] == [WINDOW, WINDOW, None, WINDOW]
    rotaries = [layer.self_attn.rotary_emb for layer in model.decoder_layers()]
    assert rotaries[0] is rotaries[1] is rotaries[3] is not rotaries[2]
    # cos of position 1 for the first pair: base 100 (local) against base 10000 scaled by 2 (global).
    assert rotaries[0].cos_sin_cache[1, 0] == pytest.approx(torch.cos(torch.tensor(1.0)).item())
    assert rotaries[2].cos_sin_cache[2, 0] == pytest.approx(rotaries[0].cos_sin_cache[1, 0].item())
    assert rotaries[0].cos_sin_cache[1, 1] != pytest.approx(rotaries[2].cos_sin_cache[1, 1].item())
    assert model.attention_layers()[0].scale == 24**-0.5


@pytest.mark.parametrize("variant", ["batch", "chunked", "preempted"])
def test_greedy_tokens_and_logprobs_match_hf(tiny, variant):
    _, folder, model = tiny
    kwargs = {"batch": {},
              # Prompts split into chunks of at most 8 tokens a step, beside running decodes.
              "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
              # Too few blocks for four sequences decoding at once: the latest admitted is preempted.
              "preempted": {"num_gpu_blocks_override": 30, "max_model_len": 96, "max_num_batched_tokens": 16,
                            "max_num_seqs": 4, "enable_prefix_caching": False},
              }[variant]
    llm = LLM(str(folder), **{**CPU, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert_matches_hf(model, outs, PROMPTS, NEW_TOKENS)
    if variant == "preempted":
        assert llm.llm_engine.engine_core.stats().num_preemptions > 0
    assert_no_leak(llm.llm_engine)


def test_prefix_cache_hits_keep_the_tokens(tiny):
    _, folder, model = tiny
    assert_prefix_hits_keep_the_tokens(folder, model, prefix_prompts(), 2 * 40, GREEDY, NEW_TOKENS, **CPU)


def test_each_group_holds_its_blocks(tiny):
    """Full-attention groups keep every block of a long sequence; sliding ones what the window reaches."""
    family, folder, _ = tiny
    llm = LLM(str(folder), **CPU)
    engine = llm.llm_engine
    kv = engine.engine_core.scheduler.kv
    assert kv.windows == {"gemma2": (None, WINDOW), "gemma3": (None, WINDOW, WINDOW, WINDOW)}[family]
    engine.add_request("long", {"prompt_token_ids": PROMPTS[2]},
                       SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held.append(kv.num_blocks_held("long"))
    full, *sliding = held[-2]  # the last step before it finished: 99 tokens
    assert full == 13 and sliding == [window_blocks(WINDOW, 8)] * len(sliding)
    assert all(max(h[1:]) <= window_blocks(WINDOW, 8) for h in held[1:])
    assert_no_leak(engine)


def test_the_engine_reports_its_groups_and_a_full_length_sequences_blocks(tiny, caplog):
    family, folder, _ = tiny
    with caplog.at_level(logging.INFO, logger="pagellm.engine.core"):
        LLM(str(folder), **CPU).llm_engine.shutdown()
    # 256 tokens: 32 blocks of 8 in a full group, 3 in a window's (12 positions span at most 3).
    expected = {"gemma2": "KV cache groups: 2 layers of full attention, 2 layers of sliding window 12; a decoding "
                          "sequence of max_model_len (256) tokens holds 35 of the",
                "gemma3": "KV cache groups: 1 layer of full attention, 1 layer of sliding window 12, 1 layer of "
                          "sliding window 12, 1 layer of sliding window 12; a decoding sequence of max_model_len "
                          "(256) tokens holds 41 of the"}[family]
    assert expected in caplog.text


def test_gemma3_with_its_vision_tower_is_refused_naming_the_text_only_class(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"hidden_size": 64}, "vision_config": {}}))
    with pytest.raises(ValueError, match=r"Gemma3ForConditionalGeneration.*not supported.*text-only Gemma3ForCausalLM"):
        LLM(str(tmp_path), device="cpu", load_format="dummy")


def test_other_activations_are_refused():
    config = ModelArchConfig.from_hf_dict({**hf_model("gemma2").config.to_dict(), "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="hidden_activation 'relu' is not supported for Gemma2ForCausalLM"):
        get_model_class(config.architecture)(config, get_attn_backend("torch"))


@pytest.mark.slow  # two rank processes (each starts Python and imports torch): tens of seconds
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_two_ranks_over_processes_match_hf(tiny, split):
    _, folder, model = tiny
    prompts = PROMPTS + prefix_prompts()
    llm = LLM(str(folder), **CPU, max_num_batched_tokens=32, max_num_seqs=4, **split)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert_matches_hf(model, outs, prompts, NEW_TOKENS)
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    finally:
        llm.llm_engine.shutdown()
