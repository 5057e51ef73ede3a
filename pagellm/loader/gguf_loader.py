"""GGUF checkpoints: metadata -> Hugging Face-style config, tensors -> dequantized HF-named weights."""
from __future__ import annotations

import re
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import torch

from pagellm.config.arch import MODEL_REGISTRY, ArchitectureEntry, ModelArchConfig
from pagellm.loader.gguf_file import GGUFFile, GGUFTensorInfo

# llama.cpp's converter permutes the q/k rows of these architectures for its rotary convention.
_PERMUTED_QK_ARCHITECTURES = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # A mixture of experts: the router, every expert's projections stacked [experts, out, in], and
    # Qwen2-MoE's shared expert and its gate.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_ARCH_LAYER_TENSORS = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}}
"""Architectures whose files name some tensors otherwise: Phi-3 keeps q/k/v fused, and gate and up
fused in ffn_up (gate's rows first)."""
_ROPE_FACTOR_TENSORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
"""LongRoPE's per-frequency factors (Phi-3's 128k models), read into the config's rope_scaling."""
_MOE_DEFAULT_NORM_TOPK = {"qwen3moe": True}
"""Whether llama.cpp renormalizes the chosen experts' weights of a GGUF architecture whose file does
not say (`expert_weights_norm`): Qwen3-MoE does, Qwen2-MoE does not (Mixtral always does)."""
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_config(gguf: GGUFFile) -> dict[str, Any]:
    """A Hugging Face `config.json`-style dict built from the file's metadata."""
    md = gguf.metadata
    arch = md.get("general.architecture")
    num_experts = md.get(f"{arch}.expert_count") or 0
    entry = gguf_architecture(gguf.path, arch, str(md.get("general.name", "")), has_experts=bool(num_experts))
    hf_arch, model_type = entry.name, entry.model_type or arch
    tensor_names = {t.name for t in gguf.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{gguf.path!r} stores per-frequency rope factors (rope_freqs, Llama 3.1+ rope scaling), "
            "which pagellm does not read from GGUF yet; load the safetensors checkpoint instead"
        )

    def key(suffix: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{suffix}", default)

    num_heads = key("attention.head_count")
    hidden = key("embedding_length")
    vocab_size = key("vocab_size") or len(md.get("tokenizer.ggml.tokens", ()))
    if num_heads is None or hidden is None or not vocab_size:
        raise ValueError(f"{gguf.path!r}: GGUF metadata lacks head count, embedding length or vocabulary size")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": key("attention.head_count_kv", num_heads),
        "head_dim": key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": key("rope.freq_base", 10000.0),
        "max_position_embeddings": key("context_length", 4096),
        # llama.cpp drops output.weight when the head shares the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
    }
    if num_experts:
        config.update(num_experts=num_experts, num_experts_per_tok=key("expert_used_count"),
                      norm_topk_prob=key("expert_weights_norm", _MOE_DEFAULT_NORM_TOPK.get(arch, False)))
        # Layers with a dense MLP in place of experts (Qwen-MoE's mlp_only_layers), told by their tensors.
        dense = sorted(int(m.group(1)) for m in map(_LAYER_NAME.fullmatch, tensor_names)
                       if m is not None and m.group(2) == "ffn_gate")
        if dense:
            config["mlp_only_layers"] = dense
        for hf_key, gguf_key in (("moe_intermediate_size", "expert_feed_forward_length"),
                                 ("shared_expert_intermediate_size", "expert_shared_feed_forward_length")):
            if key(gguf_key):
                config[hf_key] = key(gguf_key)
    rope_dims = key("rope.dimension_count")
    if arch == "phi3" and rope_dims and rope_dims != hidden // num_heads:  # Phi-4-mini rotates part of each head
        config.update(head_dim=hidden // num_heads, partial_rotary_factor=rope_dims / (hidden // num_heads))
    if key("attention.sliding_window") is not None:
        config["sliding_window"] = key("attention.sliding_window")
    scaling_type = key("rope.scaling.type")
    factors = {field: _dequantize(gguf, t).tolist()
               for t in gguf.tensors if (field := _ROPE_FACTOR_TENSORS.get(t.name))}
    if factors:  # LongRoPE: llama.cpp writes no scaling type, but the factors and the original context
        config["rope_scaling"] = {"rope_type": "longrope", **factors,
                                  "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                                  "attention_factor": key("rope.scaling.attn_factor")}
    elif scaling_type not in (None, "none"):
        rope_scaling: dict[str, Any] = {"rope_type": scaling_type, "factor": key("rope.scaling.factor", 1.0)}
        if key("rope.scaling.original_context_length") is not None:
            rope_scaling["original_max_position_embeddings"] = key("rope.scaling.original_context_length")
        config["rope_scaling"] = rope_scaling
    for hf_key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in md:
            config[hf_key] = md[f"tokenizer.ggml.{gguf_key}"]
    return config


def gguf_architecture(path: str, gguf_arch: object, name: str, has_experts: bool = False) -> ArchitectureEntry:
    """The registered architecture of a GGUF file of `general.architecture` `gguf_arch` and
    `general.name` `name`. llama.cpp files several Hugging Face architectures under one GGUF name
    (Mistral as llama), which only the model's name tells apart: an entry whose model_type is in
    the name wins, else the one whose model_type is the GGUF name. A llama file with experts
    (`has_experts`: an expert count) is Mixtral, whatever its name."""
    if has_experts and gguf_arch == "llama":
        name = "mixtral"
    entries = [e for e in MODEL_REGISTRY.entries() if e.gguf_arch is not None and e.gguf_arch == gguf_arch]
    if not entries:
        supported = dict.fromkeys(e.gguf_arch for e in MODEL_REGISTRY.entries() if e.gguf_arch)
        raise ValueError(f"{path!r}: GGUF architecture {gguf_arch!r} is not supported; supported: "
                         f"{', '.join(supported)}")
    named = [e for e in entries if e.model_type and e.model_type != gguf_arch and e.model_type in name.lower()]
    return next(iter(named), next((e for e in entries if e.model_type in (None, gguf_arch)), entries[0]))


def read_gguf_arch(path: str) -> tuple[ModelArchConfig, dict[str, Any]]:
    """`(arch, generation_config)` of a GGUF file, from its metadata only."""
    with GGUFFile(path) as gguf:
        config = gguf_to_hf_config(gguf)
    generation_config = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    return ModelArchConfig.from_hf_dict(config), generation_config


def hf_tensor_name(gguf_name: str, gguf_arch: str | None = None) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor of a `gguf_arch` file, or None for tensors HF
    does not have."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(gguf_arch, {})}
    if match is None or match.group(2) not in names:
        return None
    layer, kind, suffix = match.groups()
    return f"model.layers.{layer}.{names[kind]}.{suffix}"


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    Within each head llama.cpp stores rows as interleaved (real, imag) pairs; HF keeps the first
    half of the head's rows as one rotary half and the second half as the other.
    """
    rows = w.shape[0]
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def iter_gguf_weights(path: str, keep_quantized: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, CPU tensor)` for every weight, one tensor at a time: dequantized to float32,
    or for the names in `keep_quantized` the stored blocks as uint8 [rows, bytes per row]."""
    with GGUFFile(path) as gguf:
        config = gguf_to_hf_config(gguf)
        arch = gguf.metadata["general.architecture"]
        permuted = arch in _PERMUTED_QK_ARCHITECTURES
        heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}
        for info in gguf.tensors:
            if info.name in _ROPE_FACTOR_TENSORS:
                continue  # in the config's rope_scaling
            name = hf_tensor_name(info.name, arch)
            if name is None:
                raise ValueError(f"{path!r}: GGUF tensor {info.name!r} has no Hugging Face counterpart pagellm knows")
            if name in keep_quantized:
                tensor = torch.from_numpy(np.array(gguf.tensor_bytes(info)))
            else:
                tensor = _dequantize(gguf, info).reshape(info.shape)
            module = name.rsplit(".", 1)[0].split(".", 3)[-1]
            if permuted and module in heads:
                tensor = unpermute_rotary_rows(tensor, heads[module])
            if module == "mlp.shared_expert_gate" and tensor.dim() == 1:  # llama.cpp stores its one row as [hidden]
                tensor = tensor[None]
            yield name, tensor.contiguous()


def _dequantize(gguf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor as float32, in memory of its own (not a view of the file map)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise ValueError(f"{gguf.path!r}: tensor {info.name!r} has unknown GGML type {info.ggml_type}") from None
    try:
        array = dequantize(gguf.tensor_bytes(info), qtype)
    except NotImplementedError as e:
        raise ValueError(f"{gguf.path!r}: cannot dequantize tensor {info.name!r}: {e}") from None
    # F32 comes back as a view of the read-only file map; torch needs memory it may own.
    if not array.flags.writeable or array.dtype != np.float32:
        array = np.array(array, dtype=np.float32)
    return torch.from_numpy(array)
