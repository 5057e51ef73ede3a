"""x @ W^T for 8-bit and int4 weights, dequantized in registers: one Triton kernel for every format.

The weight stays in memory as stored (fp8/int8 [N, K], or int4 two per byte [N, K / 2]) and is
read once per tile of activation rows, so a decode step reads half (8-bit) or a quarter (int4) of
the bytes of a 16-bit weight. Each tile's product runs on the tensor cores in the activations'
dtype: an fp8 or int8 value and an int4 value minus its zero point are exact there; the scales
are applied to the float32 sums, per group of K (int4) or per output channel at the end.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr,  # x [M, K]; w [N, K] (int4: [N, K/2] bytes); scale, zero see below
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr,  # int4: K values per scale and zero point (scale, zero: [N, K / GROUP]); 0: 8-bit,
                          # scale [N] per output channel, no zero point
    IEEE: tl.constexpr,  # float32 activations: exact float32 products (not TF32)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk < K)[None, :], other=0.0)
        if GROUP > 0:
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :],
                             mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
            q = tl.interleave(packed & 0xF, packed >> 4)  # byte j holds k = 2j (low nibble) and 2j + 1
            zero = tl.load(zero_ptr + rn * stride_zn + k0 // GROUP, mask=n_ok, other=0)
            w = (q.to(tl.int32) - zero.to(tl.int32)[:, None]).to(x.dtype)
        else:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :],
                        other=0.0).to(x.dtype)
        if IEEE:
            part = tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w))
        if GROUP > 0:
            scale = tl.load(scale_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
        else:
            acc += part
    if GROUP == 0:
        acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _configs() -> list[triton.Config]:
    configs = []
    for block_n in (16, 32, 64, 128):
        for block_k in (64, 128, 256):
            for warps, stages in ((4, 3), (4, 4), (8, 3)):
                configs.append(triton.Config({"BLOCK_N": block_n, "BLOCK_K": block_k}, num_warps=warps,
                                             num_stages=stages))
    return configs


def _fits_group(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """An int4 tile must not straddle two groups of K."""
    group = named_args.get("GROUP", kwargs.get("GROUP", 0))
    return [c for c in configs if group == 0 or group % c.kwargs["BLOCK_K"] == 0] or configs[:1]


_tuned_kernel = triton.autotune(configs=_configs(), key=["N", "K", "BLOCK_M", "GROUP"],
                                prune_configs_by={"early_config_prune": _fits_group})(_dequant_matmul_kernel)


def block_m(rows: int) -> int:
    """Activation rows per tile: a decode step's few rows pad to 16 (the tensor cores' least)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128


def dequant_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                   group_size: int = 0) -> torch.Tensor:
    """x [M, K] @ dequantized(weight)^T -> [M, N] in x's dtype.

    8-bit (`group_size` 0): weight [N, K] float8_e4m3fn or int8, scale [N] (float32):
    W = weight * scale. int4: weight [N, K / 2] uint8 (k = 2j in byte j's low nibble, 2j + 1 in
    its high one), scale [N, K / group_size], zero [N, K / group_size] uint8:
    W = (q - zero) * scale.
    """
    rows, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    zero_arg = zero if zero is not None else scale
    bm = block_m(rows)
    args = (x, weight, scale, zero_arg, out, rows, n, k, x.stride(0), weight.stride(0), scale.stride(0),
            zero_arg.stride(0), out.stride(0))
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(rows, bm))  # noqa: E731
        _tuned_kernel[grid](*args, GROUP=group_size, IEEE=x.dtype == torch.float32, BLOCK_M=bm)
    else:  # Triton's interpreter (TRITON_INTERPRET=1): the tests' small shapes, one fixed tile
        block_k = 32 if group_size == 0 else min(group_size, 32)
        grid = (triton.cdiv(n, 16), triton.cdiv(rows, bm))
        _dequant_matmul_kernel[grid](*args, GROUP=group_size, IEEE=x.dtype == torch.float32, BLOCK_M=bm,
                                     BLOCK_N=16, BLOCK_K=block_k)
    return out
