"""Rotary position embedding (rotate-half / GPT-NeoX layout, as Hugging Face Llama)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm import ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any], max_position: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling: stretch long wavelengths by `factor`, keep short ones.

    Wavelengths between the two thresholds blend the two linearly in (original context / wavelength).
    """
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    original_context = scaling.get("original_max_position_embeddings", max_position)
    wavelen = 2 * math.pi / inv_freq
    smooth = ((original_context / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None, max_position: int) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, after `rope_scaling` (HF dict)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling, max_position)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported (rope_scaling={rope_scaling}); "
        "supported: default, linear, llama3"
    )


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token's position, from a float32 cos/sin table built once.

    Runs `pagellm.ops`: q and k in one Triton kernel on a GPU, PyTorch elsewhere.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling, max_position)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos in the first half, sin in the second.
        self.register_buffer("cos_sin_cache", torch.cat((angles.cos(), angles.sin()), dim=-1), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, num_heads, head_dim]; key [T, num_kv_heads, head_dim]."""
        return ops.rotary_embedding(positions, query, key, self.cos_sin_cache)
