"""Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention, routed experts plus a shared expert scaled by a
sigmoid gate; layers in `mlp_only_layers` or off `decoder_sparse_step` keep a dense MLP."""
from __future__ import annotations

from pagellm.config.arch import ModelArchConfig
from pagellm.models.llama import LlamaAttention
from pagellm.models.moe import MoECausalLM


class Qwen2MoeAttention(LlamaAttention):
    @staticmethod
    def projection_biases(config: ModelArchConfig) -> tuple[bool, bool]:
        return config.hf_config.get("qkv_bias", True), False


class Qwen2MoeForCausalLM(MoECausalLM):
    attention_cls = Qwen2MoeAttention
    has_shared_expert = True
