"""Qwen3-MoE: Qwen3's attention (q/k norms) with routed experts, no shared expert."""
from __future__ import annotations

from pagellm.models.moe import MoECausalLM
from pagellm.models.qwen3 import Qwen3Attention


class Qwen3MoeForCausalLM(MoECausalLM):
    attention_cls = Qwen3Attention
