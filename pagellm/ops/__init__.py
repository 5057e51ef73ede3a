"""The small ops of a decoder layer, each either PyTorch or one fused Triton kernel.

Dispatch (`dispatch.resolve_impl`): an explicit `impl` argument wins, then a `use_impl(...)` block,
else Triton for tensors on a GPU when `triton` imports, the C kernels (`cpu_ops`) for float32 CPU
tensors when they build, PyTorch otherwise. Triton is optional: its kernel modules are imported
only when a Triton implementation runs.
"""
from __future__ import annotations

import torch

from pagellm.ops import torch_ops
from pagellm.ops.c import cpu_ops
from pagellm.ops.dispatch import IMPLS, Impl, resolve_impl, triton_available, use_impl

__all__ = [
    "IMPLS", "Impl", "argmax", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul",
    "triton_available", "use_impl",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl | None = None) -> torch.Tensor:
    """x [..., N] / rms(x) * weight [N], normalised in float32 and cast back before the weight."""
    chosen = resolve_impl(x, impl)
    if chosen == "triton":
        from pagellm.ops.triton import norm as triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return _cpu_or_torch(chosen).rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, impl: Impl | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the next block's input and its residual stream."""
    chosen = resolve_impl(x, impl)
    if chosen == "triton":
        from pagellm.ops.triton import norm as triton_norm

        return triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    return _cpu_or_torch(chosen).fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor, impl: Impl | None = None) -> torch.Tensor:
    """x [..., 2d] (gate, up) -> silu(gate) * up [..., d]."""
    chosen = resolve_impl(x, impl)
    if chosen == "triton":
        from pagellm.ops.triton import activation as triton_activation

        return triton_activation.silu_and_mul(x)
    return _cpu_or_torch(chosen).silu_and_mul(x)


def argmax(x: torch.Tensor, impl: Impl | None = None) -> torch.Tensor:
    """x [R, V] -> int64 [R]: each row's index of its largest value (the first, NaN the largest),
    as `x.argmax(dim=-1)`."""
    if resolve_impl(x, impl) == "triton":
        from pagellm.ops.triton import argmax as triton_argmax

        return triton_argmax.argmax(x)
    return x.argmax(dim=-1)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    impl: Impl | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding: positions [T], query [T, H, D], key [T, Hkv, D] -> new (query, key)."""
    chosen = resolve_impl(query, impl)
    if chosen == "triton":
        from pagellm.ops.triton import rotary as triton_rotary

        return triton_rotary.rotary_embedding(positions, query, key, cos_sin_cache)
    return _cpu_or_torch(chosen).rotary_embedding(positions, query, key, cos_sin_cache)


def _cpu_or_torch(impl: Impl):
    """The module of a non-Triton implementation."""
    if impl == "cpu":
        return cpu_ops
    return torch_ops
