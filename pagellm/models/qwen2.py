"""Qwen2: Llama with a bias on the q/k/v projections."""
from __future__ import annotations

from pagellm.config.arch import ModelArchConfig
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    @staticmethod
    def projection_biases(config: ModelArchConfig) -> tuple[bool, bool]:
        return True, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen2Attention
