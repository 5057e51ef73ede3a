"""GPT-OSS against Hugging Face `transformers`: a tiny random model built from `GptOssConfig` (sliding
and full layers alternating, the window shorter than every prompt, 6 experts top-2 with biases and
clamped SwiGLU, YaRN rotary scaling, attention sinks well away from zero), saved as safetensors, and
the same model with its experts stored as MXFP4 blocks. Greedy tokens and logprobs through the engine
(chunked prefill, prefix caching, preemption; TP=2, EP=2 and PP=2 over processes), YaRN's cos/sin table
against transformers', the preset and the planner, and what is refused."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from engine_utils import assert_no_leak
from family_utils import (
    assert_attention_adapter_served_and_moe_adapter_refused,
    assert_matches_hf,
    assert_prefix_hits_keep_the_tokens,
    save_with_tokenizer,
)
from safetensors.torch import load_file, save_file
from test_mxfp4 import random_mxfp4
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.modeling_rope_utils import _compute_yarn_parameters
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from pagellm import LLM, SamplingParams
from pagellm.attention import get_attn_backend
from pagellm.benchmarks.plan import resolve_arch
from pagellm.cli.main import main as cli_main
from pagellm.config.arch import ModelArchConfig
from pagellm.layers.rotary import RotaryEmbedding, rope_attention_scale, rope_inv_freq
from pagellm.loader.presets import get_preset
from pagellm.models import get_model_class
from pagellm.models.cpu_layer import why_not_fused
from pagellm.worker.loading import prompt_hidden_states

NEW_TOKENS = 32
VOCAB = 256
WINDOW = 12
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0}
"""Scaled from 64 positions: the prompts and their continuations reach past it."""
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, num_local_experts=6, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=512, rope_parameters=YARN, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              architectures=["GptOssForCausalLM"])
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((17, 33, 40, 13))]
SHARED_PREFIX = [(11 * j) % 250 + 3 for j in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20, block_size=8)


def hf_model(config: transformers.GptOssConfig | None = None, seed: int = 0):
    """transformers' GPT-OSS at CONFIG's size, random weights: routers scaled up so that tokens pick
    their experts decisively, sinks of about the scores' size (zero would already weigh one key's worth)."""
    config = config or transformers.GptOssConfig(**CONFIG)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif name.endswith("sinks"):
                p.normal_(0.0, 1.5)
            else:
                p.normal_(0.0, 0.25 if ".router." in name else 0.08)
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(its folder, its Hugging Face model)."""
    folder = tmp_path_factory.mktemp("gpt-oss")
    model = hf_model()
    save_with_tokenizer(model, folder)
    return folder, model


def prefix_prompts() -> list[list[int]]:
    return [SHARED_PREFIX + [5 + i, 9 + i] for i in range(3)]


def run(folder: Path, prompts: list[list[int]], **kwargs) -> tuple[list, LLM]:
    llm = LLM(str(folder), **{**CPU, **kwargs})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False), llm


def engine_model(hf) -> torch.nn.Module:
    config = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    model = get_model_class(config.architecture)(config, get_attn_backend("torch"))
    assert model.load_weights(hf.state_dict().items()) == {name for name, _ in model.named_parameters()}
    return model


def hf_variant(model, state: dict | None = None, **changes):
    """`model` under its config with `changes`, its weights `state` (default its own)."""
    config = transformers.GptOssConfig(**{**model.config.to_dict(), **changes})
    variant = hf_model(config)
    variant.load_state_dict(state or model.state_dict())
    return variant


def test_logits_match_hf_and_every_difference_from_llama_matters():
    hf = hf_model()
    model = engine_model(hf)
    assert [a.sliding_window for a in model.attention_layers()] == [WINDOW, None, WINDOW, None]
    tokens = torch.tensor(PROMPTS[2])
    with torch.no_grad():
        reference = hf(tokens[None]).logits[0]
        torch.testing.assert_close(model.compute_logits(prompt_hidden_states(model, tokens.tolist())), reference,
                                   atol=1e-4, rtol=1e-4)
        no_sinks = {k: v.fill_(-1e4) if k.endswith("sinks") else v for k, v in hf.state_dict().items()}
        no_router_bias = {k: v.zero_() if k.endswith("router.bias") else v for k, v in hf.state_dict().items()}
        no_expert_bias = {k: v.zero_() if k.endswith("_proj_bias") else v for k, v in hf.state_dict().items()}
        for variant in (hf_variant(hf, sliding_window=1000), hf_variant(hf, rope_parameters={
                "rope_type": "default", "rope_theta": 10000.0}), hf_variant(hf, swiglu_limit=1.0),
                hf_variant(hf, no_sinks), hf_variant(hf, no_router_bias), hf_variant(hf, no_expert_bias)):
            assert not torch.allclose(variant(tokens[None]).logits[0], reference, atol=1e-3)
    assert why_not_fused(model.decoder_layers()[0]) == "its MLP is a GptOssMoE, not a dense Llama MLP"


def test_routing_is_not_degenerate():
    """Every layer sends the test prompts' tokens to every one of its experts."""
    model = hf_model()
    chosen = []  # per prompt: [layers, tokens x top-k] experts
    for prompt in PROMPTS + [SHARED_PREFIX]:
        with torch.no_grad():
            router_logits = model(torch.tensor([prompt]), output_router_logits=True).router_logits
        chosen.append(torch.stack([logits.topk(2, dim=-1).indices.flatten() for logits in router_logits]))
    assert all(set(layer.tolist()) == set(range(6)) for layer in torch.cat(chosen, dim=1))


@pytest.mark.parametrize("variant", ["batch", "torch backend", "chunked", "preempted",
                                     pytest.param("triton backend", marks=pytest.mark.slow)])  # interpreted: 30 s
def test_greedy_tokens_and_logprobs_match_hf(tiny, variant):
    folder, model = tiny
    kwargs = {"batch": {},  # the C attention kernels
              "torch backend": {"attention_backend": "torch"},
              # Its kernels under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET).
              "triton backend": {"attention_backend": "triton"},
              # Prompts split into chunks of at most 8 tokens a step, beside running decodes.
              "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
              # Too few blocks for four sequences decoding at once: the latest admitted is preempted.
              "preempted": {"num_gpu_blocks_override": 30, "max_model_len": 96, "max_num_batched_tokens": 16,
                            "max_num_seqs": 4, "enable_prefix_caching": False},
              }[variant]
    outs, llm = run(folder, PROMPTS, **kwargs)
    assert_matches_hf(model, outs, PROMPTS, NEW_TOKENS)
    if variant == "preempted":
        assert llm.llm_engine.engine_core.stats().num_preemptions > 0
    assert_no_leak(llm.llm_engine)


def test_prefix_cache_hits_keep_the_tokens(tiny):
    folder, model = tiny
    assert_prefix_hits_keep_the_tokens(folder, model, prefix_prompts(), 2 * 40, GREEDY, NEW_TOKENS, **CPU)


@pytest.mark.slow  # two rank processes (each starts Python and imports torch): tens of seconds
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2},
                                   {"tensor_parallel_size": 2, "enable_expert_parallel": True},
                                   {"pipeline_parallel_size": 2}], ids=["tp2", "ep2", "pp2"])
def test_two_ranks_over_processes_match_hf(tiny, split):
    folder, model = tiny
    prompts = PROMPTS + prefix_prompts()
    outs, llm = run(folder, prompts, max_num_batched_tokens=32, max_num_seqs=4, **split)
    try:
        assert_matches_hf(model, outs, prompts, NEW_TOKENS)
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    finally:
        llm.llm_engine.shutdown()


# -- MXFP4 checkpoints -------------------------------------------------------------------------------------------------

def save_mxfp4(folder: Path) -> torch.nn.Module:
    """A tiny GPT-OSS whose experts are stored as OpenAI stores them: `gate_up_proj_blocks` / `_scales`
    [experts, 2 x intermediate, hidden / 32, (16)] (rows gate, up, gate, ...), `down_proj_blocks` /
    `_scales` [experts, hidden, intermediate / 32, (16)], biases beside them, and `quant_method`
    mxfp4. Returns transformers' model holding those experts dequantized (its reference)."""
    model = hf_model(seed=1)
    experts, inter, hidden = 6, CONFIG["intermediate_size"], CONFIG["hidden_size"]
    save_with_tokenizer(model, folder)
    tensors = load_file(folder / "model.safetensors")
    for layer in range(CONFIG["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.mlp.experts."
        quantized = {"gate_up_proj": random_mxfp4(experts, 2 * inter, hidden // 32, seed=2 * layer),
                     "down_proj": random_mxfp4(experts, hidden, inter // 32, seed=2 * layer + 1)}
        for name, (blocks, scales) in quantized.items():
            scales -= 6  # scales of 2^-11 .. 2^4: weights mostly below 0.2
            del tensors[prefix + name]
            tensors[prefix + name + "_blocks"], tensors[prefix + name + "_scales"] = blocks, scales
            with torch.no_grad():
                getattr(model.model.layers[layer].mlp.experts, name).copy_(convert_moe_packed_tensors(blocks, scales))
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return model


def test_an_mxfp4_checkpoint_loads_dequantized_and_matches_hf(tmp_path):
    model = save_mxfp4(tmp_path)
    outs, llm = run(tmp_path, PROMPTS[:2])
    assert llm.llm_engine.config.model.quantization is None  # dense weights in the engine
    assert_matches_hf(model, outs, PROMPTS[:2], NEW_TOKENS)


def test_mxfp4_is_refused_where_it_cannot_load(tiny, tmp_path):
    folder, _ = tiny
    with pytest.raises(ValueError, match=r"quantization .--quantization. 'mxfp4' loads a checkpoint quantized with "
                                         r"mxfp4, and .* has no such quantization_config"):
        LLM(str(folder), **CPU, quantization="mxfp4")
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
             "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match="pagellm loads mxfp4 checkpoints of GptOssForCausalLM only, and .* holds "
                                         "LlamaForCausalLM"):
        LLM(str(tmp_path), **CPU, load_format="dummy")


# -- YaRN -----------------------------------------------------------------------------------------------------------

YARN_CASES = {
    "gpt-oss": (dict(rope_theta=150000.0, factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                     original_max_position_embeddings=4096), 131072, 64),
    "qwen": (dict(rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768), 131072, 128),
    "deepseek mscale": (dict(rope_theta=1e4, factor=40.0, mscale=0.707, mscale_all_dim=1.0,
                             original_max_position_embeddings=4096), 163840, 64),
    "factor from the context": (dict(rope_theta=1e4, factor=None, original_max_position_embeddings=64), 512, 32),
    "attention_factor": (dict(rope_theta=1e4, factor=8.0, attention_factor=0.9, beta_fast=4.0, beta_slow=2.0,
                              original_max_position_embeddings=64), 512, 32),
}


@pytest.mark.parametrize("case", sorted(YARN_CASES))
def test_yarn_matches_transformers(case):
    """The frequencies, the attention factor and the cos/sin table (its scale folded in) are
    transformers' bit for bit."""
    params, max_position, head_dim = YARN_CASES[case]
    scaling = {"rope_type": "yarn", **params}
    config = transformers.GptOssConfig(head_dim=head_dim, hidden_size=4 * head_dim, num_attention_heads=4,
                                       max_position_embeddings=max_position, rope_parameters=dict(scaling))
    inv_freq, attention_factor = _compute_yarn_parameters(config)
    assert torch.equal(rope_inv_freq(head_dim, params["rope_theta"], scaling, max_position), inv_freq)
    assert rope_attention_scale(scaling, max_position) == attention_factor
    positions = torch.tensor([0, 1, 2, 100, 63, 64, 511, max_position - 1])
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), positions[None])
    table = RotaryEmbedding(head_dim, max_position, params["rope_theta"], scaling).cos_sin_cache[positions]
    assert torch.equal(table, torch.cat((cos[0], sin[0]), dim=-1))


def test_yarn_needs_its_original_context():
    with pytest.raises(ValueError, match="rope_scaling of type yarn needs original_max_position_embeddings"):
        RotaryEmbedding(32, 128, 1e4, {"rope_type": "yarn", "factor": 4.0})


# -- presets, the planner, refusals -----------------------------------------------------------------------------------

def test_the_presets_shapes_and_plan(capsys):
    config, generation = get_preset("openai/gpt-oss-20b")
    arch = ModelArchConfig.from_hf_dict(config)
    assert (arch.num_hidden_layers, arch.hidden_size, arch.num_attention_heads, arch.num_key_value_heads,
            arch.head_dim, arch.num_experts, arch.num_experts_per_tok, arch.vocab_size) == (
        24, 2880, 64, 8, 64, 32, 4, 201088)
    assert arch.sliding_windows == (128, None) * 12 and generation["eos_token_id"] == [200002, 199999, 200012]
    assert resolve_arch("openai/gpt-oss-120b")[1].num_experts == 128
    assert cli_main(["plan", "openai/gpt-oss-20b", "--gpu-memory-gib", "80", "--max-model-len", "8192",
                     "--input-len", "8000", "--output-len", "192", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # The experts dequantized to bfloat16: about 21B parameters of 2 bytes.
    assert 38 < plan["weights_bytes"] / 2**30 < 40 and plan["quantization"] == "none"
    # 8192 tokens: 512 blocks of 16 for a full layer; a decode's 128-token window spans at most 9.
    assert [(g["sliding_window"], len(g["layers"]), g["blocks_per_seq"]) for g in plan["kv_cache_groups"]] == [
        (None, 12, 512), (128, 12, 9)]


def test_a_checkpoint_missing_expert_tensors_names_them(tiny, tmp_path):
    folder, _ = tiny
    (tmp_path / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.experts.down_proj_bias"},
              tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\): model\.layers\.2\.mlp\.experts\.down_proj_bias$"):
        LLM(str(tmp_path), **CPU)


def test_attention_adapters_are_served_and_router_adapters_refused(tiny, tmp_path):
    folder, _ = tiny
    assert_attention_adapter_served_and_moe_adapter_refused(hf_model(), folder, tmp_path, PROMPTS[2], "router", 64, 6,
                                                            **CPU)


def test_another_swiglu_is_refused():
    config = ModelArchConfig.from_hf_dict({**transformers.GptOssConfig(**CONFIG).to_dict(), "swiglu_limit": 10.0})
    with pytest.raises(ValueError, match="config.json's swiglu_limit is 10.0: pagellm's GPT-OSS experts compute the "
                                         "clamped SwiGLU of swiglu_limit 7.0 only"):
        get_model_class(config.architecture)(config, get_attn_backend("torch"))
