"""silu(gate) * up as one Triton kernel."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.ops.triton.utils import last_dim_contiguous, pdl, pdl_start

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2 * D], last dim contiguous: gate in [:D], up in [D:]
    out_ptr,  # [T, D] contiguous
    stride_xt,
    D,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,  # see `pdl`
):
    # Program (token, column block).
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + D + cols, mask=mask, other=0.0)
    # PyTorch rounds silu(gate) to the input dtype before the product; so do we, to match it.
    act = (gate * tl.sigmoid(gate)).to(up.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + t * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] (gate, up) -> silu(gate) * up [..., d], a new contiguous tensor."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dimension (gate, up), got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = last_dim_contiguous(x).reshape(-1, 2 * d)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, _BLOCK))](x2, out, x2.stride(0), d, BLOCK=_BLOCK, num_warps=4,
                                                              **pdl(x.device))
    return out
