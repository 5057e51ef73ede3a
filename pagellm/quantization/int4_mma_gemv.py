"""One activation row times a 4-bit weight on the tensor cores: decode at batch 1 for int4 layers
(GPTQ, AWQ, rtn) whose groups are whole multiples of 128 input features (one a row included).

`triton_matmul._gemv_kernel` multiplies on the CUDA cores: an and and a multiply-add a code, and at
3.4-3.6 instructions a code in all it is bound by issuing them, not by memory (the README's
quantization section). Here a code costs about one instruction. The weight's int32 words of eight
codes (k = 8i + j in word i's bits 4j..4j+3) are read 16 a row at a time (128 inputs); code j of
every word is one "plane", a [rows, 16] operand whose input features are k = 8i + j. Two words'
code j go into one register as the bfloat16 pair (128 + c, 128 + c') with a single and-or (the
code in the low bits of a bfloat16 whose exponent says 128 is the integer 128 + c, exactly). Each
plane meets the matching activations (x[8i + j], one column of an otherwise zero [16, 16]
operand) in a tensor-core product that sums in float32. The 128 each code carries comes off once a
group: sum (c - z) x = sum (128 + c) x - (128 + z) sum x. The products are exact (a bfloat16 times
an integer below 144) and the sums float32, as in the CUDA-core kernel.

Layers with fewer rows than the GPU has multiprocessors split K among programs (SPLIT_K): each
writes its float32 sums, and the last to finish a tile of rows (a counter per tile, which it
resets) adds them in order and writes the output, so the result does not depend on timing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.ops.dispatch import triton_interpreting
from pagellm.ops.triton_utils import pdl, pdl_release, pdl_wait

CHUNK = tl.constexpr(128)
"""Input features a program takes each time round: 16 int32 words a row."""

_PLANES_ASM = tl.constexpr("""{
.reg .b32 lo, hi, t;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 $0, lo, 0x000F000F, 0x43004300, 0xea;
shr.u32 t, lo, 4;
lop3.b32 $1, t, 0x000F000F, 0x43004300, 0xea;
shr.u32 t, lo, 8;
lop3.b32 $2, t, 0x000F000F, 0x43004300, 0xea;
shr.u32 t, lo, 12;
lop3.b32 $3, t, 0x000F000F, 0x43004300, 0xea;
lop3.b32 $4, hi, 0x000F000F, 0x43004300, 0xea;
shr.u32 t, hi, 4;
lop3.b32 $5, t, 0x000F000F, 0x43004300, 0xea;
shr.u32 t, hi, 8;
lop3.b32 $6, t, 0x000F000F, 0x43004300, 0xea;
shr.u32 t, hi, 12;
lop3.b32 $7, t, 0x000F000F, 0x43004300, 0xea;
}""")
"""Two words a and b (consecutive elements of a thread's words) -> eight bfloat16 pairs, pair j
= (128 + code j of a, 128 + code j of b). prmt puts a's low half word beside b's (and the high
halves), so that codes j and j + 4 of both words sit 16 bits apart, and one lop3 (and 0x000F000F,
or 0x43004300: the bits of bfloat16 128) makes each pair."""


@triton.jit
def _planes(words, ASM: tl.constexpr):
    """int32 words [R, 16] -> eight [R, 16] planes, plane j = 128 + code j of each word, in
    bfloat16 (with ASM, the GPU's two-words-a-register form) or float32 (Triton's interpreter,
    whose bfloat16 products are not exact)."""
    if ASM:
        p = tl.inline_asm_elementwise(_PLANES_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        p = tuple(((words >> (4 * j)) & 0xF).to(tl.float32) + 128.0 for j in range(8))
    return p


@triton.jit
def int4_mma_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr,  # x [K]; w int32 [N, K / 8]; scale [N, K / GROUP]
    part_ptr, count_ptr,  # SPLIT_K > 1: float32 [SPLIT_K, N] sums; int32 [cdiv(N, BLOCK_N)] zeroed counters
    N, K, stride_wn, stride_sn, stride_zn,
    GROUP: tl.constexpr,  # input features a scale, a multiple of CHUNK
    ZERO: tl.constexpr,  # -1: zero_ptr's uint8 [N, K / GROUP]; else every code's zero point
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    ASM: tl.constexpr,  # the GPU's planes (see _planes)
    PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rw = tl.arange(0, CHUNK // 8)
    col = tl.arange(0, 16)
    DOT: tl.constexpr = tl.bfloat16 if ASM else tl.float32
    acc = tl.zeros((BLOCK_N, 16), dtype=tl.float32)  # column 0: sum s (128 + c) x
    offsets = tl.zeros((BLOCK_N,), dtype=tl.float32)  # sum of (128 + z) s sum x over the groups
    span = K // SPLIT_K
    w_rows = w_ptr + rn[:, None] * stride_wn
    pdl_release(PDL)
    pdl_wait(PDL)
    for k0 in range(pid_k * span, (pid_k + 1) * span, CHUNK):
        words = tl.load(w_rows + k0 // 8 + rw[None, :], mask=n_ok[:, None], other=0)
        planes = _planes(words, ASM)
        sums = tl.zeros((BLOCK_N, 16), dtype=tl.float32)
        x_sums = tl.zeros((CHUNK // 8,), dtype=tl.float32)
        for j in tl.static_range(8):
            x_j = tl.load(x_ptr + k0 + 8 * rw + j)
            x_sums += x_j.to(tl.float32)
            sums = tl.dot(planes[j], tl.broadcast_to(x_j[:, None], (CHUNK // 8, 16)).to(DOT), sums)
        x_sum = tl.sum(x_sums, axis=0)
        if ZERO == -1:
            zero = tl.load(zero_ptr + rn * stride_zn + k0 // GROUP, mask=n_ok, other=0).to(tl.float32) + 128.0
        else:
            zero = tl.full((BLOCK_N,), 128.0 + ZERO, tl.float32)
        scale = tl.load(scale_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        acc += sums * scale[:, None]
        offsets += zero * scale * x_sum
    total = tl.sum(tl.where(col[None, :] == 0, acc, 0.0), axis=1) - offsets  # every column is the same
    if SPLIT_K == 1:
        tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.store(part_ptr + pid_k * N + rn, total, mask=n_ok)
        tl.debug_barrier()  # every thread's sums stored before the count says so
        done = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the last of the tile's programs: sum in order, reset the counter
            total = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * N + rn, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + rn, total.to(out_ptr.dtype.element_ty), mask=n_ok)
            tl.atomic_xchg(count_ptr + pid_n, 0)


MAX_TILES = 8192
"""Tiles of rows a product may have with SPLIT_K > 1 (counters kept a device and stream)."""


def fits(n: int, k: int, group: int, block_n: int, split_k: int) -> bool:
    """Whether the kernel takes a layer with this tile: groups of whole chunks, K split into whole
    chunks, few enough tiles for the counters."""
    return group > 0 and group % CHUNK.value == 0 and k % (CHUNK.value * split_k) == 0 and (split_k == 1 or -(-n // block_n) <= MAX_TILES)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """MAX_TILES zeroed counters, one set a device and stream: the kernel leaves them zeroed, and
    two products at once on one stream cannot happen (on two streams they could). Never freed, so
    that a CUDA graph may keep their address."""
    key = (device, torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0)
    found = _COUNTERS.get(key)
    if found is None:
        found = _COUNTERS[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return found


def configs() -> list[triton.Config]:
    """The tiles `one_row_tiles.choose` times for this kernel: rows a program, K split in parts."""
    return [triton.Config({"MMA": True, "BLOCK_N": n, "SPLIT_K": s}, num_warps=2, num_stages=3)
            for n in (64, 128) for s in (1, 2, 4, 8)]


def launch(config: triton.Config, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
           out: torch.Tensor, n: int, k: int, stride_wn: int, stride_sn: int, stride_zn: int, group: int,
           zero_const: int) -> None:
    """out [n] = x [k] @ W^T for int32 words `w` [n, k / 8] with `config`'s tile (`fits` it)."""
    block_n, split_k = config.kwargs["BLOCK_N"], config.kwargs["SPLIT_K"]
    part = torch.empty(split_k, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    count = counters(x.device) if split_k > 1 else w
    int4_mma_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, scale, zero, out, part, count, n, k, stride_wn, stride_sn, stride_zn, GROUP=group, ZERO=zero_const,
        SPLIT_K=split_k, BLOCK_N=block_n, ASM=not triton_interpreting(), num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl(x.device))
