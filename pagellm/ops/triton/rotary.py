"""Rotary position embedding (rotate-half / GPT-NeoX layout) for q and k in one Triton kernel."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.ops.triton.utils import last_dim_contiguous, num_warps_for, pdl, pdl_start


@triton.jit
def rotate_heads(
    src_ptr,  # this token's [H, 2 * HALF] heads, last dim contiguous
    dst_ptr,  # this token's [H, 2 * HALF] output heads, last dim contiguous, heads dst_stride_h apart
    stride_h, dst_stride_h, H, cos, sin,  # cos, sin: [BLOCK_HALF] float32
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < H) & (d < HALF)
    x1 = tl.load(src_ptr + h * stride_h + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + h * stride_h + HALF + d, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the source's type first (as the unfused path stores it), then to the destination's
    # (a float8 KV cache).
    out1 = (x1 * cos[None, :] - x2 * sin[None, :]).to(src_ptr.dtype.element_ty)
    out2 = (x2 * cos[None, :] + x1 * sin[None, :]).to(src_ptr.dtype.element_ty)
    dst = dst_ptr + h * dst_stride_h + d
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] integer
    q_ptr,  # [T, HQ, 2 * HALF], last dim contiguous
    k_ptr,  # [T, HK, 2 * HALF], last dim contiguous
    cache_ptr,  # [max_position, 2 * HALF]: cos in [:HALF], sin in [HALF:]
    q_out_ptr,  # [T, HQ, 2 * HALF] contiguous
    k_out_ptr,  # [T, HK, 2 * HALF] contiguous
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    HQ, HK,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    PDL: tl.constexpr = False,  # see `pdl`
):
    # One program per token: its cos/sin row is loaded once for every q and k head.
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    row = cache_ptr + pos * stride_cache
    cos = tl.load(row + d, mask=d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(row + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    rotate_heads(q_ptr + t * stride_qt, q_out_ptr + t * HQ * 2 * HALF, stride_qh, 2 * HALF, HQ, cos, sin,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    rotate_heads(k_ptr + t * stride_kt, k_out_ptr + t * HK * 2 * HALF, stride_kh, 2 * HALF, HK, cos, sin,
                  HALF, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; query [T, H, D]; key [T, Hkv, D] (views of a fused qkv are fine) -> new contiguous
    rotated (query, key); cos_sin_cache [max_position, D] has cos in the first half of a row, sin in the second.
    """
    head_dim = query.shape[-1]
    if head_dim % 2 or key.shape[-1] != head_dim or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(
            f"rotary embedding needs one even head_dim for query {tuple(query.shape)}, key {tuple(key.shape)} "
            f"and cos_sin_cache {tuple(cos_sin_cache.shape)}"
        )
    q, k = last_dim_contiguous(query), last_dim_contiguous(key)
    cache = last_dim_contiguous(cos_sin_cache)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    block_hq, block_hk = triton.next_power_of_2(q.shape[1]), triton.next_power_of_2(k.shape[1])
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(q.shape[0],)](
        positions, q, k, cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cache.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        num_warps=num_warps_for(block_hq * block_half), **pdl(q.device),
    )
    return q_out, k_out
