"""Qwen3: Llama with an RMSNorm over each query and key head before the rotary embedding."""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionBackend
from pagellm.config.arch import ModelArchConfig
from pagellm.layers import RMSNorm, RotaryEmbedding
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelArchConfig, rotary_emb: RotaryEmbedding, attn_backend: AttentionBackend,
                 sliding_window: int | None = None) -> None:
        super().__init__(config, rotary_emb, attn_backend, sliding_window)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_cls = Qwen3Attention
