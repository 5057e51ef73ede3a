"""Mixtral, Qwen2-MoE and Qwen3-MoE against Hugging Face `transformers`: tiny random models built
from each family's own config class (several layers, top-2 of 6 or 8 experts, Qwen2-MoE's shared
expert and a dense layer), saved as safetensors. Greedy tokens and logprobs through the engine
(chunked prefill, prefix caching, preemption; TP=2, EP=2 and PP=2 over processes), the experts' tensor-
and expert-parallel shards against one rank, and the errors of what is not supported."""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from attn_utils import build_metadata
from engine_utils import assert_no_leak
from family_utils import (
    assert_attention_adapter_served_and_moe_adapter_refused,
    assert_matches_hf,
    assert_prefix_hits_keep_the_tokens,
    save_with_tokenizer,
)
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.attention import get_attn_backend
from pagellm.config.arch import ModelArchConfig
from pagellm.distributed import init_tensor_parallel
from pagellm.engine.arg_utils import EngineArgs
from pagellm.layers.moe import STACKED, FusedMoE
from pagellm.models import get_model_class
from pagellm.models.cpu_layer import why_not_fused
from pagellm.worker.loading import build_model, prompt_hidden_states

NEW_TOKENS = 32
VOCAB = 256
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, rms_norm_eps=1e-6)
FAMILIES = {
    # Every layer's MLP is 6 experts of Llama's intermediate_size; weights always renormalized.
    "mixtral": ("MixtralForCausalLM", dict(num_local_experts=6, intermediate_size=48)),
    # A shared expert beside the routed ones; layer 1 dense (mlp_only_layers); weights not renormalized.
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(num_experts=6, intermediate_size=96, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                              norm_topk_prob=False)),
    # q/k norms, head_dim * heads != hidden_size; weights renormalized.
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=8, intermediate_size=96, moe_intermediate_size=32,
                                              head_dim=32, norm_topk_prob=True)),
}
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 40))]
SHARED_PREFIX = [(11 * j) % 250 + 3 for j in range(40)]
"""Two and a half KV blocks of 16 tokens that several prompts start with (prefix caching)."""
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20)


def hf_model(family: str):
    """The family's Hugging Face model with random weights: routers scaled up, so that tokens pick
    their experts decisively and differently (not a near-uniform, near-tie routing)."""
    arch, kwargs = FAMILIES[family]
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(architectures=[arch], **COMMON, **kwargs)
    torch.manual_seed(sorted(FAMILIES).index(family))
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.2 if name.endswith("mlp.gate.weight") else 0.08)
    return model


def save_tiny(folder: Path, family: str):
    """`hf_model(family)` saved as safetensors (one tensor per expert and projection, as
    transformers writes them) with a word-level tokenizer; returns the model."""
    model = hf_model(family)
    save_with_tokenizer(model, folder)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    """(family, its folder, its Hugging Face model)."""
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, save_tiny(folder, request.param)


def prefix_prompts() -> list[list[int]]:
    return [SHARED_PREFIX + [5 + i, 9 + i] for i in range(3)]


def run(folder: Path, prompts: list[list[int]], **kwargs) -> tuple[list, LLM]:
    llm = LLM(str(folder), **{**CPU, **kwargs})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return outs, llm


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_routing_is_not_degenerate(family):
    """Every MoE layer sends the test prompts' tokens to every one of its experts."""
    model = hf_model(family)
    chosen = []  # per prompt, per MoE layer: the experts of each token
    for prompt in PROMPTS + [SHARED_PREFIX]:
        with torch.no_grad():
            router_logits = model(torch.tensor([prompt]), output_router_logits=True).router_logits
        chosen.append(torch.stack([logits.topk(2, dim=-1).indices for logits in router_logits]))
    per_layer = torch.cat(chosen, dim=1).flatten(1)
    assert all(set(layer.tolist()) == set(range(router_logits[0].shape[-1])) for layer in per_layer)


@pytest.mark.parametrize("variant", ["batch", "chunked", "preempted"])
def test_greedy_tokens_and_logprobs_match_hf(tiny, variant):
    _, folder, model = tiny
    kwargs = {"batch": {},
              # Prompts split into chunks of at most 8 tokens a step, beside running decodes.
              "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
              # 12 blocks of 16 tokens for four sequences needing 17: the latest admitted is preempted.
              "preempted": {"num_gpu_blocks_override": 12, "max_model_len": 128, "enable_prefix_caching": False},
              }[variant]
    outs, llm = run(folder, PROMPTS, **kwargs)
    assert_matches_hf(model, outs, PROMPTS, NEW_TOKENS)
    if variant == "preempted":
        assert llm.llm_engine.engine_core.stats().num_preemptions > 0
    assert_no_leak(llm.llm_engine)


def test_prefix_cache_hits_keep_the_tokens(tiny):
    _, folder, model = tiny
    assert_prefix_hits_keep_the_tokens(folder, model, prefix_prompts(), 2 * 32, GREEDY, NEW_TOKENS, **CPU)


@pytest.mark.slow  # two rank processes (each starts Python and imports torch): tens of seconds
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2},
                                   {"tensor_parallel_size": 2, "enable_expert_parallel": True},
                                   {"pipeline_parallel_size": 2}], ids=["tp2", "ep2", "pp2"])
def test_two_ranks_over_processes_match_hf(tiny, split):
    _, folder, model = tiny
    outs, llm = run(folder, PROMPTS + prefix_prompts(), max_num_batched_tokens=32, max_num_seqs=4, **split)
    try:
        assert_matches_hf(model, outs, PROMPTS + prefix_prompts(), NEW_TOKENS)
        assert llm.llm_engine.get_stats().prefix_cache_hits > 0
    finally:
        llm.llm_engine.shutdown()


# -- the layer: shards and loaders, without processes ---------------------------------------------------------------

def _routed(num_experts: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(11, 16, generator=gen)
    logits = torch.randn(11, num_experts, generator=gen) * 3
    gate, up, down = (torch.randn(num_experts, *shape, generator=gen) / 4 for shape in ((24, 16), (24, 16), (16, 24)))
    return x, logits, gate, up, down


def _experts_as_rank(rank: int, world: int, expert_parallel: bool, gate, up, down, stacked: bool) -> FusedMoE:
    init_tensor_parallel(rank, world, expert_parallel=expert_parallel)
    try:
        moe = FusedMoE(gate.shape[0], 2, 16, 24, renormalize=True)
    finally:
        init_tensor_parallel(0, 1)
    init_tensor_parallel(rank, world, expert_parallel=expert_parallel)  # the loaders read the rank too
    try:
        if stacked:
            moe.w13_weight.weight_loader(moe.w13_weight, torch.cat([gate, up], dim=1), (STACKED, "w13"))
            moe.w2_weight.weight_loader(moe.w2_weight, down, (STACKED, "w2"))
        else:
            for e in range(gate.shape[0]):
                moe.w13_weight.weight_loader(moe.w13_weight, gate[e], (e, "w1"))
                moe.w13_weight.weight_loader(moe.w13_weight, up[e], (e, "w3"))
                moe.w2_weight.weight_loader(moe.w2_weight, down[e], (e, "w2"))
    finally:
        init_tensor_parallel(0, 1)
    return moe


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_ranks_partial_outputs_sum_to_one_ranks(expert_parallel, stacked):
    x, logits, gate, up, down = _routed()
    whole = _experts_as_rank(0, 1, False, gate, up, down, stacked=False)
    expected = whole(x, logits)
    ranks = [_experts_as_rank(r, 2, expert_parallel, gate, up, down, stacked) for r in range(2)]
    if expert_parallel:  # whole experts: rank 1 holds experts 3-5, and maps the others to -1
        assert torch.equal(ranks[1].w13_weight[0], torch.cat([gate[3], up[3]]))
        assert ranks[1].expert_map.tolist() == [-1, -1, -1, 0, 1, 2]
    else:  # every expert's second half of the intermediate size
        assert torch.equal(ranks[1].w13_weight[4], torch.cat([gate[4, 12:], up[4, 12:]]))
        assert torch.equal(ranks[1].w2_weight[4], down[4, :, 12:])
    torch.testing.assert_close(ranks[0](x, logits) + ranks[1](x, logits), expected, atol=1e-5, rtol=1e-5)


def test_weight_loader_refuses_wrong_shapes_and_experts():
    x, logits, gate, up, down = _routed()
    moe = _experts_as_rank(0, 1, False, gate, up, down, stacked=False)
    with pytest.raises(ValueError, match=r"expert 2's w1 projection has shape \(24, 15\), expected \(24, 16\)"):
        moe.weight_loader(moe.w13_weight, gate[2, :, :15], (2, "w1"))
    with pytest.raises(ValueError, match="expert 6: the model has 6 experts"):
        moe.weight_loader(moe.w13_weight, gate[2], (6, "w1"))
    with pytest.raises(ValueError, match=r"\[6 experts, out, in\]"):
        moe.weight_loader(moe.w2_weight, down[:4], (STACKED, "w2"))


def _gpt_oss_mlp():
    """transformers' GptOssMLP (router and experts) at a tiny size, random weights."""
    config = transformers.GptOssConfig(hidden_size=16, intermediate_size=24, num_local_experts=6,
                                       num_experts_per_tok=2)
    config._experts_implementation = "eager"
    mlp = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (2.0 if name.startswith("router") else 0.5))
    return mlp


def _gpt_oss_experts_as_rank(rank: int, world: int, expert_parallel: bool, mlp) -> FusedMoE:
    """GPT-OSS's experts in the engine: their checkpoint layout (gate/up interleaved; transformers'
    parameters transposed back) loaded as this rank's share."""
    init_tensor_parallel(rank, world, expert_parallel=expert_parallel)
    try:
        moe = FusedMoE(6, 2, 16, 24, renormalize=False, scoring="topk_softmax", activation="swigluoai", bias=True)
        experts = mlp.experts
        for param, tensor, part in ((moe.w13_weight, experts.gate_up_proj.transpose(1, 2), "w13_interleaved"),
                                    (moe.w13_bias, experts.gate_up_proj_bias, "w13_interleaved"),
                                    (moe.w2_weight, experts.down_proj.transpose(1, 2), "w2"),
                                    (moe.w2_bias, experts.down_proj_bias, "w2")):
            param.weight_loader(param, tensor.detach(), (STACKED, part))
    finally:
        init_tensor_parallel(0, 1)
    return moe


@pytest.mark.parametrize("split", [None, "tp", "ep"])
def test_gpt_oss_experts_load_and_match_hf(split):
    """GPT-OSS's MoE block (its router's top-k softmax, biased experts, clamped SwiGLU) over one rank,
    or as two ranks' partial sums: the gate/up biases split as their rows, the down bias added once."""
    mlp = _gpt_oss_mlp()
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected, _ = mlp(x[None])
        logits = torch.nn.functional.linear(x, mlp.router.weight, mlp.router.bias)
    ranks = ([_gpt_oss_experts_as_rank(0, 1, False, mlp)] if split is None
             else [_gpt_oss_experts_as_rank(r, 2, split == "ep", mlp) for r in range(2)])
    out = sum(moe(x, logits) for moe in ranks)
    torch.testing.assert_close(out, expected[0], atol=1e-5, rtol=1e-5)
    if split == "tp":  # rank 1: the second half of every expert's gate and up biases; no down bias added
        bias = mlp.experts.gate_up_proj_bias.detach()
        assert torch.equal(ranks[1].w13_bias[2], torch.cat([bias[2, 0::2][12:], bias[2, 1::2][12:]]))
        assert [moe.adds_down_bias for moe in ranks] == [True, False]
    if split == "ep":  # rank 1: experts 3-5 whole, each adding its own down bias
        assert torch.equal(ranks[1].w2_bias[0], mlp.experts.down_proj_bias.detach()[3])
        assert [moe.adds_down_bias for moe in ranks] == [True, True]


def test_expert_biases_load_one_expert_at_a_time():
    mlp = _gpt_oss_mlp()
    whole = _gpt_oss_experts_as_rank(0, 1, False, mlp)
    moe = FusedMoE(6, 2, 16, 24, renormalize=False, activation="swigluoai", bias=True)
    bias, down_bias = whole.w13_bias.detach(), whole.w2_bias.detach()
    for e in range(6):
        moe.weight_loader(moe.w13_bias, bias[e, :24], (e, "w1"))
        moe.weight_loader(moe.w13_bias, bias[e, 24:], (e, "w3"))
        moe.weight_loader(moe.w2_bias, down_bias[e], (e, "w2"))
    assert torch.equal(moe.w13_bias, whole.w13_bias) and torch.equal(moe.w2_bias, whole.w2_bias)
    with pytest.raises(ValueError, match=r"expert 1's w2 bias has shape \(15,\), expected \(16,\)"):
        moe.weight_loader(moe.w2_bias, down_bias[1, :15], (1, "w2"))
    with pytest.raises(ValueError, match=r"stacked expert bias of shape \(6, 16, 1\): expected \[6 experts, out\]"):
        moe.weight_loader(moe.w2_bias, down_bias[..., None], (STACKED, "w2"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_state_dict_with_stacked_experts_loads_and_matches(family):
    """transformers v5 holds experts as 3-D tensors (`mlp.experts.gate_up_proj`), Mixtral's block as
    `mlp`: the same model loads from those names, its logits HF's."""
    hf = hf_model(family)
    config = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    model = get_model_class(config.architecture)(config, get_attn_backend("torch"))
    state = hf.state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in state)
    assert model.load_weights(state.items()) == {name for name, _ in model.named_parameters()}
    tokens = PROMPTS[2]
    with torch.no_grad():
        ours = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)),
                                          build_metadata([(0, len(tokens), [0, 1, 2])], 16)))
        torch.testing.assert_close(ours, hf(torch.tensor([tokens])).logits[0], atol=1e-4, rtol=1e-4)
    if family != "qwen3_moe":  # whose q/k norms already keep its layers off the fused C layer
        assert why_not_fused(model.decoder_layers()[0]) == "its MLP is a MoEBlock, not a dense Llama MLP"


def test_moe_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    config = ModelArchConfig.from_hf_dict({**COMMON, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                           "intermediate_size": 96, "num_hidden_layers": 6,
                                           "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [config.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not ModelArchConfig.from_hf_dict({**COMMON, "architectures": ["Qwen3ForCausalLM"],
                                             "intermediate_size": 96}).is_moe_layer(0)
    with pytest.raises(ValueError, match="num_experts_per_tok must be between 1 and the 4 experts, got 5"):
        ModelArchConfig.from_hf_dict({**COMMON, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
                                      "intermediate_size": 96, "num_experts_per_tok": 5})


# -- GGUF files ------------------------------------------------------------------------------------------------------

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
              "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def write_gguf(path: str, model, family: str) -> None:
    """`model` laid out as llama.cpp's converter writes it (float32): experts as 3-D tensors, the
    shared expert's gate as one vector, q/k rows permuted for the llama architecture (Mixtral),
    named so that only its expert count says it is Mixtral."""
    config, arch = model.config, GGUF_ARCH[family]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_expert_count(FAMILIES[family][1].get("num_experts") or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if family != "mixtral":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if family == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        if name in top:
            writer.add_tensor(top[name], tensor.numpy())
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if rest == "mlp.experts.gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", gate.contiguous().numpy())
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", up.contiguous().numpy())
            continue
        if rest == "mlp.experts.down_proj":
            module, suffix = rest, "weight"
        if module == "mlp.shared_expert_gate":
            tensor = tensor[0]
        if arch == "llama" and module in heads and suffix == "weight":
            n = heads[module]
            tensor = tensor.reshape(n, 2, tensor.shape[0] // n // 2, -1).transpose(1, 2).reshape(tensor.shape)
        writer.add_tensor(f"blk.{layer}.{GGUF_LAYER[module]}.{suffix}", tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_files_load_dequantized_and_match_hf(family, tmp_path):
    hf = hf_model(family)
    path = str(tmp_path / f"{family}.gguf")
    write_gguf(path, hf, family)
    config = EngineArgs(path, device="cpu", dtype="float32").create_engine_config()
    assert config.model.source.arch.architecture == FAMILIES[family][0]
    assert config.model.quantization is None  # the blocks are dequantized: experts load dense
    model = build_model(config.model.source, None, torch.float32, torch.device("cpu"), "torch", 0)
    tokens = PROMPTS[2]
    with torch.no_grad():
        ours = model.compute_logits(prompt_hidden_states(model, tokens))
        torch.testing.assert_close(ours, hf(torch.tensor([tokens])).logits[0], atol=1e-4, rtol=1e-4)


# -- what is refused ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2-moe")
    save_tiny(folder, "qwen2_moe")
    return folder


def _copy_without(src: Path, dst: Path, drop) -> str:
    dst.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (dst / name).write_text((src / name).read_text())
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not drop(k)}, dst / "model.safetensors")
    return str(dst)


def test_a_checkpoint_missing_expert_tensors_names_them(qwen2_moe_dir, tmp_path):
    one = _copy_without(qwen2_moe_dir, tmp_path / "one", lambda k: k == "model.layers.2.mlp.experts.4.up_proj.weight")
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*: model\.layers\.2\.mlp\.experts\.4\.up_proj\.weight$"):
        LLM(one, **CPU)
    layer = _copy_without(qwen2_moe_dir, tmp_path / "layer", lambda k: k.startswith("model.layers.0.mlp.experts."))
    with pytest.raises(ValueError, match=r"lacks 18 tensor\(s\): model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight, "
                                         r"model\.layers\.0\.mlp\.experts\.0\.up_proj\.weight, .*, \.\.\.$"):
        LLM(layer, **CPU)


def test_unsupported_architecture_names_the_supported_ones(qwen2_moe_dir, tmp_path):
    config = json.loads((qwen2_moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["DeepseekV3ForCausalLM"]}))
    with pytest.raises(ValueError, match="'DeepseekV3ForCausalLM'.* is not supported; supported: .*MixtralForCausalLM, "
                                         "Qwen2MoeForCausalLM, Qwen3MoeForCausalLM"):
        LLM(str(tmp_path), load_format="dummy", **CPU)


def test_quantized_experts_are_refused(qwen2_moe_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization .--quantization. is 'int8', but Qwen2MoeForCausalLM is a "
                                         "mixture of experts.*leave quantization .--quantization. out"):
        LLM(str(qwen2_moe_dir), **CPU, quantization="int8")
    folder = _copy_without(qwen2_moe_dir, tmp_path / "gptq", lambda k: False)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="the checkpoint holds gptq weights .* mixture of experts"):
        LLM(folder, **CPU)


def test_expert_parallel_flag_is_checked_against_the_model(qwen2_moe_dir, tmp_path, caplog):
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(--tensor-parallel-size\) 4 must divide the model's "
                                         r"6 experts with enable_expert_parallel \(--enable-expert-parallel\)"):
        EngineArgs(model=str(qwen2_moe_dir), device="cpu", tensor_parallel_size=4,
                   enable_expert_parallel=True).create_engine_config()
    config = EngineArgs(model=str(qwen2_moe_dir), device="cpu", tensor_parallel_size=2,
                        enable_expert_parallel=True).create_engine_config()
    assert config.parallel.enable_expert_parallel
    # Experts of 31 intermediate channels split over 2 ranks only as whole experts.
    config = json.loads((qwen2_moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 31}))
    odd = dict(model=str(tmp_path), load_format="dummy", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"2 must divide the model's moe_intermediate_size \(31\), or place whole "
                                         r"experts on the ranks: enable_expert_parallel"):
        EngineArgs(**odd).create_engine_config()
    assert EngineArgs(**odd, enable_expert_parallel=True).create_engine_config().parallel.enable_expert_parallel
    with caplog.at_level(logging.WARNING):
        dense = EngineArgs(model="llama-3.2-1b", load_format="dummy", device="cpu",
                           enable_expert_parallel=True).create_engine_config()
    assert not dense.parallel.enable_expert_parallel
    assert "has no effect: LlamaForCausalLM is not a mixture of experts" in caplog.text
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_args(["--enable-expert-parallel"]).enable_expert_parallel is True


def test_adapters_of_experts_are_refused_and_attention_adapters_served(qwen2_moe_dir, tmp_path):
    assert_attention_adapter_served_and_moe_adapter_refused(hf_model("qwen2_moe"), qwen2_moe_dir, tmp_path, PROMPTS[2],
                                                            "experts.1.down_proj", 32, 64, **CPU)
