"""Rotary position embedding (rotate-half / GPT-NeoX layout, as Hugging Face Llama)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagellm import ops

LONGROPE_TYPES = ("longrope", "su")
"""Phi-3's LongRoPE, under its current and its first name."""


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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `factor` times: 0.1 x mscale x ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(scaling: dict[str, Any], max_position: int) -> float:
    """YaRN's `factor`, by default the context's extension max_position / original (DeepSeek-V3's way)."""
    factor = scaling.get("factor")
    return factor if factor is not None else max_position / _original_context(scaling, "yarn")


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict[str, Any], max_position: int) -> torch.Tensor:
    """YaRN ("NTK-by-parts"): frequencies that turn fewer than `beta_slow` times over the original
    context are divided by `factor` (interpolated), those that turn more than `beta_fast` times are
    kept (extrapolated), the pair indices between blend linearly; `truncate` (default true) rounds
    that range outwards to whole pairs. Hugging Face's `_compute_yarn_parameters`, step for step."""
    factor = _yarn_factor(scaling, max_position)
    original = _original_context(scaling, "yarn")
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def pair(rotations: float) -> float:  # the (fractional) pair index whose frequency turns so many times
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair(beta_fast), pair(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    wavelengths = base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    return 1.0 / (factor * wavelengths) * (1 - extrapolated) + 1.0 / wavelengths * extrapolated


def _rope_type(rope_scaling: dict[str, Any] | None) -> str:
    return (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))


def _original_context(scaling: dict[str, Any], rope_type: str = "longrope") -> int:
    original = scaling.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling of type {rope_type} needs original_max_position_embeddings (in rope_scaling "
                         f"or config.json), got {original!r}")
    return original


def uses_long_factors(scaling: dict[str, Any], max_position: int, context_len: int | None) -> bool:
    """Whether LongRoPE rotates by its long factors: when the engine's context (`context_len`,
    default `max_position`) exceeds the original one, for every position of every sequence.

    Hugging Face picks the factors per forward pass by the sequence's current length, and recomputes
    a sequence's cache when it crosses the original context; a paged KV cache shared by sequences of
    every length cannot, so one choice holds for the engine, as vLLM makes it: a model served within
    its original context matches Hugging Face exactly, and one served beyond it matches Hugging Face
    on sequences longer than the original context (shorter ones get the long factors too)."""
    return (context_len or max_position) > _original_context(scaling)


def _longrope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any], max_position: int,
                       context_len: int | None) -> torch.Tensor:
    """LongRoPE's frequencies: each one divided by its own factor, the short or the long set."""
    long = uses_long_factors(scaling, max_position, context_len)
    key = "long_factor" if long else "short_factor"
    factors = scaling.get(key)
    if not isinstance(factors, (list, tuple)) or len(factors) != head_dim // 2:
        raise ValueError(f"rope_scaling {key} must be a list of head_dim / 2 = {head_dim // 2} numbers, got "
                         f"{len(factors) if isinstance(factors, (list, tuple)) else factors!r}")
    # Hugging Face's arithmetic, so that the angles round as its do.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base**exponents)


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict[str, Any] | None, max_position: int,
                  context_len: int | None = None) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in float32, after `rope_scaling` (HF dict).
    `context_len`: the longest sequence the engine runs (LongRoPE chooses its factors by it)."""
    rope_type = _rope_type(rope_scaling)
    if rope_type in LONGROPE_TYPES:
        return _longrope_inv_freq(head_dim, base, rope_scaling, max_position, context_len)
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling, max_position)
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, rope_scaling, max_position)
    raise ValueError(
        f"rope_scaling type {rope_type!r} is not supported (rope_scaling={rope_scaling}); "
        "supported: default, linear, llama3, longrope (su), yarn"
    )


def rope_attention_scale(rope_scaling: dict[str, Any] | None, max_position: int) -> float:
    """What cos and sin are multiplied by (so q.k by its square): 1 but for LongRoPE and YaRN, or
    their `attention_factor`. LongRoPE's defaults to sqrt(1 + ln(factor) / ln(original context)),
    `factor` to the context's extension max_position / original (1 where it is not extended), for
    either set of factors (as Hugging Face and vLLM); YaRN's to 0.1 ln(factor) + 1, or with `mscale`
    and `mscale_all_dim` (DeepSeek) the ratio of that correction with each (Hugging Face's)."""
    rope_type = _rope_type(rope_scaling)
    if rope_type not in (*LONGROPE_TYPES, "yarn"):
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    if rope_type == "yarn":
        factor = _yarn_factor(rope_scaling, max_position)
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    original = _original_context(rope_scaling)
    factor = rope_scaling.get("factor") or max_position / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token's position, from a float32 cos/sin table built once.

    Runs `pagellm.ops`: q and k in one Triton kernel on a GPU, PyTorch elsewhere.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict[str, Any] | None = None,
        context_len: int | None = None,
    ) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling, max_position, context_len)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # [max_position, head_dim]: cos in the first half, sin in the second; LongRoPE's attention
        # factor folded in, where every kernel that reads the table applies it.
        table = torch.cat((angles.cos(), angles.sin()), dim=-1) * rope_attention_scale(rope_scaling, max_position)
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; query [T, num_heads, head_dim]; key [T, num_kv_heads, head_dim]."""
        return ops.rotary_embedding(positions, query, key, self.cos_sin_cache)


class MRotaryEmbedding(RotaryEmbedding):
    """Multimodal rotary embedding (Qwen2-VL's M-RoPE): a token has three positions (temporal,
    height, width) and each third of the rotated pairs, as `mrope_section` splits them, turns by
    one of them. Text tokens have all three equal, which is the plain rotation: positions [T] are
    taken as such (decode steps, prompts without images)."""

    def __init__(self, head_dim: int, max_position: int, base: float, mrope_section: list[int]) -> None:
        super().__init__(head_dim, max_position, base)
        if len(mrope_section) != 3 or sum(mrope_section) != head_dim // 2:
            raise ValueError(f"rope_scaling's mrope_section must be three numbers summing to head_dim / 2 = "
                             f"{head_dim // 2}, got {mrope_section!r}")
        pair_axis = torch.repeat_interleave(torch.arange(3), torch.tensor(mrope_section))
        # Which of the three positions each column of the cos/sin table (cos half, sin half) takes.
        self.register_buffer("column_axis", torch.cat((pair_axis, pair_axis)), persistent=False)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] or [3, T]; query [T, num_heads, head_dim]; key [T, num_kv_heads, head_dim]."""
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        rows = self.cos_sin_cache[positions]  # [3, T, head_dim]
        axis = self.column_axis.view(1, 1, -1).expand(1, rows.shape[1], -1)
        per_token = rows.gather(0, axis)[0]  # [T, head_dim]: each column from its own position
        index = torch.arange(per_token.shape[0], device=positions.device)
        return ops.rotary_embedding(index, query, key, per_token)
