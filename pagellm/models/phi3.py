"""Phi-3 (Phi-3 and Phi-3.5 mini and medium): Llama's graph, its checkpoints holding the q/k/v and the
gate/up projections fused (`qkv_proj`, `gate_up_proj`), and LongRoPE rope scaling for the 128k models.

A fused tensor is split into its parts before the parts are sharded: with tensor parallelism a rank
holds its heads' rows of q, of k and of v, and its slice of gate and of up, as for Llama."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.config.arch import ModelArchConfig
from pagellm.models.llama import LlamaForCausalLM

_FUSED = {".self_attn.qkv_proj.": ((".self_attn.q_proj.", ".self_attn.k_proj.", ".self_attn.v_proj."), ("q", "k", "v")),
          ".mlp.gate_up_proj.": ((".mlp.gate_proj.", ".mlp.up_proj."), (0, 1))}
"""A fused projection's name part -> (its parts' Llama name parts, their shard ids)."""
_SPLIT_SUFFIXES = ("weight", "bias")
"""What of a fused projection splits by rows: dense weights and biases (GGUF blocks are rows too)."""


def _rotary_fraction(config: ModelArchConfig) -> float:
    """The share of each head the rotary embedding turns (Phi-4-mini: 0.75)."""
    return config.hf_config.get("partial_rotary_factor", (config.rope_scaling or {}).get("partial_rotary_factor", 1.0))


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, loading `Phi3ForCausalLM` checkpoints (safetensors, or llama.cpp's phi3 GGUF files)."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        if _rotary_fraction(config) != 1.0:
            raise ValueError(f"partial_rotary_factor {_rotary_fraction(config)} (a rotary embedding over part of "
                             "each head, as Phi-4-mini's) is not supported; Phi3ForCausalLM runs with 1.0 only")
        super().__init__(config, attn_backend)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._split_fused(weights))

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each fused projection's split into its parts (rows),
        named as Llama's: what the Llama loader shards."""
        config = self.config
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        sizes = {".self_attn.qkv_proj.": [q, kv, kv], ".mlp.gate_up_proj.": [config.intermediate_size] * 2}
        for name, tensor in weights:
            fused = next((part for part in _FUSED if part in name), None)
            if fused is None:
                yield name, tensor
                continue
            if name.rpartition(".")[2] not in _SPLIT_SUFFIXES:
                raise ValueError(f"checkpoint tensor {name!r}: a quantized fused projection of Phi-3 is not "
                                 "supported; load a dense (or GGUF) checkpoint")
            if tensor.shape[0] != sum(sizes[fused]):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                                 f"{' + '.join(map(str, sizes[fused]))}: does config.json describe the same model "
                                 "as the weights?")
            for part, rows in zip(_FUSED[fused][0], tensor.split(sizes[fused])):
                yield name.replace(fused, part), rows

    def checkpoint_parts(self, param_name: str) -> dict[object, str]:
        fused = next((part for part in _FUSED if part in param_name), None)
        if fused is None:
            return super().checkpoint_parts(param_name)
        return {shard: param_name for shard in _FUSED[fused][1]}
