"""RMSNorm as one Triton kernel, optionally fused with the residual add before it.

Numerics match `torch_ops.rms_norm` / `fused_add_rms_norm`: the sum x + residual is rounded to the
input dtype (it is the residual stream the next layer reads), squared and averaged in float32,
normalised, cast to the input dtype, then multiplied by the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.ops.triton.utils import last_dim_contiguous, num_warps_for, pdl, pdl_release, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [A, B, N], last dim contiguous
    residual_ptr,  # [A, B, N], last dim contiguous; unused without HAS_RESIDUAL
    weight_ptr,  # [N]
    out_ptr,  # [A * B, N] contiguous
    new_residual_ptr,  # [A * B, N] contiguous; unused without HAS_RESIDUAL
    stride_xa, stride_xb, stride_ra, stride_rb,
    B, N, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= N
    PDL: tl.constexpr = False,  # see `pdl`
):
    # One program per row; A and B are the leading dims (tokens, and heads for a per-head norm).
    row = tl.program_id(0).to(tl.int64)
    a = row // B
    b = row % B
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    pdl_release(PDL)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)  # no kernel writes it: read before the wait
    pdl_wait(PDL)
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + a * stride_ra + b * stride_rb + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * N + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    normed = (x32 * rstd).to(x_ptr.dtype.element_ty)
    out = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., N] as [A, B, N] without a copy for [T, N] and [T, H, N] views (e.g. heads split from qkv)."""
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(1)
    return x.flatten(0, -3)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    new_residual: torch.Tensor | None,
) -> None:
    x3 = _as_3d(last_dim_contiguous(x))
    # Without a residual the kernel never touches its residual pointers; any tensor will do.
    r3 = x3 if residual is None else _as_3d(last_dim_contiguous(residual))
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3, r3, weight, out, out if new_residual is None else new_residual,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        x3.shape[1], n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block), **pdl(x.device),
    )


def _empty_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The dtype `weight * normed` has in PyTorch (the input's, when the weight matches it).
    return torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] -> rms_norm(x) * weight, a new contiguous tensor."""
    out = _empty_out(x, weight)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual), both new contiguous tensors."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual must match x in shape and dtype: got residual {tuple(residual.shape)} {residual.dtype}, "
            f"x {tuple(x.shape)} {x.dtype}"
        )
    out = _empty_out(x, weight)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, new_residual)
    return out, new_residual
