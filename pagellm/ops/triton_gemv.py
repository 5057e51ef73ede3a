"""y = x W^T for a few rows of x: the weight-streaming matmul of small decode batches.

At batch 1 a decode step reads every weight once and does two FLOPs per weight, so its speed is
how close these products come to the memory bandwidth. Each program owns BLOCK_N output
features and streams their [BLOCK_N, K] weight rows in BLOCK_K-wide tiles (contiguous along K,
so every load is coalesced), keeping the few rows of x in registers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4
"""Most rows of x the kernel takes; larger batches amortise the weights well enough for cuBLAS."""
TUNING = {"block_n": 8, "block_k": 512, "num_warps": 4, "num_stages": 4}
"""Launch configuration, chosen on an H200 by benchmarks/gemv_bench.py."""


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K], last dim contiguous
    w_ptr,  # [N, K], last dim contiguous
    b_ptr,  # [N] or unused
    y_ptr,  # [M, N] contiguous
    M, N, stride_xm, stride_wn,
    K: tl.constexpr,  # a model dimension: a compile-time trip count (and the interpreter needs an int)
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_m = tl.arange(0, BLOCK_M)
    n_ok = rows_n < N
    m_ok = rows_m < M
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + rows_m[:, None] * stride_xm + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        acc += tl.sum(w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows_m[:, None] * N + rows_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: dict | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) @ weight [N, K]^T (+ bias [N]) -> [M, N], accumulated in float32."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS or weight.shape[1] != k:
        raise ValueError(f"gemv takes x [M <= {MAX_ROWS}, K] and weight [N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("gemv needs a weight whose last dimension is contiguous")
    cfg = config or TUNING
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg["block_n"]),)](
        x, weight, bias if bias is not None else y, y, m, n, x.stride(0), weight.stride(0), K=k,
        HAS_BIAS=bias is not None, BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=cfg["block_n"],
        BLOCK_K=cfg["block_k"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return y
