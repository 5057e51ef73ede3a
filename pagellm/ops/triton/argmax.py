"""Each row's argmax as two Triton kernels: every program reduces one chunk of a row, one more
program a row reduces the chunks.

PyTorch reduces a row in one block of threads: over a 128,256-word vocabulary that took 37.6 us
on an H100 for one row of logits (more than a tenth of the LM head's time, for a greedy batch-1
step; `benchmarks/step_timeline.py`). Split over many programs the row is a few
microseconds. A value and its index travel as one int64 key whose order is that of
`torch.argmax`: larger values first, NaN above everything, +0 and -0 equal, and among equals the
lowest index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 4096
"""Inputs one program reduces: 32 a thread at 4 warps."""
MAX_COLUMNS = 65535 * _CHUNK
"""The most chunks a row can launch (a grid's second dimension): 268,431,360 columns."""


@triton.jit
def _keys(x, idx):
    """int64 keys ordered as (x, -idx), x in float32: its bits made monotonic (a negative's
    magnitude bits flipped), NaN mapped to the top, -0 to +0, the index below in the low 32 bits."""
    x = x + 0.0  # -0 + 0 = +0
    bits = x.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    ordered = tl.where(x != x, 0x7FFFFFFF, ordered)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - idx).to(tl.int64)


@triton.jit
def _chunk_argmax_kernel(x_ptr, keys_ptr, V, stride_x, CHUNKS, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
    # Past the row's end: below every key of a real value (-inf's included).
    keys = tl.where(idx < V, _keys(x, idx), -9223372036854775807 - 1)
    tl.store(keys_ptr + row * CHUNKS + chunk, tl.max(keys, axis=0))


@triton.jit
def _row_argmax_kernel(keys_ptr, out_ptr, CHUNKS, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keys = tl.load(keys_ptr + row * CHUNKS + cols, mask=cols < CHUNKS, other=-9223372036854775807 - 1)
    best = tl.max(keys, axis=0)
    tl.store(out_ptr + row, 0x7FFFFFFF - (best & 0x7FFFFFFF))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> int64 [R], each row's first largest value's index: the kernels for 16- and
    32-bit floats (compared in float32, exactly) up to MAX_COLUMNS columns, PyTorch otherwise."""
    if x.dim() != 2:
        raise ValueError(f"argmax takes [rows, columns], got shape {tuple(x.shape)}")
    rows, v = x.shape
    if v == 0:
        raise ValueError("argmax needs at least one column")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or v > MAX_COLUMNS:
        # float64 would be rounded to the kernels' float32; a longer row needs more chunks than a grid holds.
        return x.argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    chunks = triton.cdiv(v, _CHUNK)
    keys = torch.empty(rows, chunks, dtype=torch.int64, device=x.device)
    _chunk_argmax_kernel[(rows, chunks)](x, keys, v, x.stride(0), chunks, CHUNK=_CHUNK, num_warps=4)
    block = triton.next_power_of_2(chunks)
    _row_argmax_kernel[(rows,)](keys, out, chunks, BLOCK=block, num_warps=1 if block <= 128 else 4)
    return out
