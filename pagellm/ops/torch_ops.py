"""The PyTorch implementations: the CPU path, and the oracle every Triton kernel is tested against."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] / rms(x) * weight [N]; normalised in float32 and cast back before the weight (as HF Llama)."""
    if x.dtype == torch.float32 == weight.dtype:
        # The same arithmetic in one ATen op (about 2.5x faster than the composite on a CPU).
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype before it is normalised."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] (gate, up) -> silu(gate) * up [..., d]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX) rotary embedding, as new tensors.

    positions [T]; query [T, H, D]; key [T, Hkv, D]; cos_sin_cache [max_position, D] with cos in
    the first half of a row and sin in the second.
    """
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(-2).chunk(2, dim=-1)
    # q and k rotated as one tensor: half the small ops, which is what a CPU decode step pays for.
    num_heads = query.shape[1]
    both = _rotate(torch.cat((query, key), dim=1), cos, sin)
    return both[:, :num_heads], both[:, num_heads:]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
