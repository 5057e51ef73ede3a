"""One activation row times a 4-bit weight on the tensor cores: decode at batch 1 for int4 layers
(GPTQ, AWQ, rtn) whose groups are whole multiples of 128 input features (one a row included).

`triton_matmul._gemv_kernel` multiplies on the CUDA cores: an and and a multiply-add a code, and at
3.4-3.6 instructions a code in all it is bound by issuing them, not by memory (the README's
quantization section); here a code costs about one. The weight's int32 words of eight codes
(k = 8i + j in word i's bits 4j..4j+3) are read 16 a row at a time (a chunk of 128 inputs). Code j
of every word is one "plane", a [16, rows] operand whose inputs are k = 8i + j. Two words' code j
go into one register as the bfloat16 pair (128 + c, 128 + c') by a single and-or (a code in the
low bits of a bfloat16 whose exponent says 128 is the integer 128 + c, exactly). Plane j meets
x[8i + j] (the same in each of the 16 rows of the other operand, the tensor cores' least), taken
from the int32 words of x: the low or high half of word 4i + j / 2. Every operand comes from a
dense tile that Triton's pipelined copies bring ahead of use; a plane's activations spelled as a
strided load, a column mask or a broadcast cost a pass through shared memory and a barrier each.

The 128 each code carries comes off once a group: sum (c - z) x = sum (128 + c) x - (128 + z) sum x,
the activations' sum from a product with ones (x[k0 + 16r ...][:16] in row r < 8: each row a part,
where the plane products are whole in every row, hence their weight 1/16). The products are exact
(a bfloat16 times an integer below 144) and the sums float32, as in the CUDA-core kernel.

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


_X_ASM = tl.constexpr("""{
prmt.b32 $0, $2, $3, 0x5410;
prmt.b32 $1, $2, $3, 0x7632;
}""")
"""Two int32 words of activations a and b -> their low halves (a bfloat16 pair) and their high ones."""


@triton.jit
def _plane(words, j: tl.constexpr):
    """128 + code j of each word, in float32."""
    return ((words >> (4 * j)) & 0xF).to(tl.float32) + 128.0


@triton.jit
def _planes(words, ASM: tl.constexpr):
    """int32 words -> eight planes, plane j = 128 + code j of each word, in bfloat16 (with ASM,
    the GPU's two-words-a-register form) or float32 (Triton's interpreter, whose bfloat16
    products are not exact)."""
    if ASM:
        p = tl.inline_asm_elementwise(_PLANES_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [words],
                                      dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
    else:
        p = (_plane(words, 0), _plane(words, 1), _plane(words, 2), _plane(words, 3), _plane(words, 4),
             _plane(words, 5), _plane(words, 6), _plane(words, 7))
    return p


@triton.jit
def _x_planes(x_ptr, k0, ri, rows, q: tl.constexpr, ASM: tl.constexpr):
    """Planes 2q and 2q + 1 of the chunk's activations, x[k0 + 8i + 2q (+ 1)] in each of 16 rows."""
    if ASM:  # one dense tile of int32 words (two activations each), split by halves in registers
        words = tl.load(x_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + (k0 + 8 * ri[None, :]) // 2 + q
                        + 0 * rows[:, None])
        low, high = tl.inline_asm_elementwise(_X_ASM, "=r,=r,r,r", [words], dtype=(tl.bfloat16, tl.bfloat16),
                                              is_pure=True, pack=2)
    else:
        at = x_ptr + k0 + 8 * ri[None, :] + 2 * q + 0 * rows[:, None]
        low, high = tl.load(at).to(tl.float32), tl.load(at + 1).to(tl.float32)
    return low, high


@triton.jit
def int4_mma_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr,  # x [K] (4-byte aligned); w int32 [N, K / 8]; scale [N, K / GROUP]
    part_ptr, count_ptr,  # SPLIT_K > 1: float32 [SPLIT_K, N] sums; int32 [cdiv(N, BLOCK_N)] zeroed counters
    N, K, stride_wn, stride_sn, stride_zn,
    GROUP: tl.constexpr,  # input features a scale, a multiple of CHUNK
    ZERO: tl.constexpr,  # -1: zero_ptr's uint8 [N, K / GROUP]; else every code's zero point
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_N: tl.constexpr,  # BLOCK_N divides N
    ASM: tl.constexpr,  # the GPU's planes (see _planes)
    PDL: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # no masks where tiles fill N: their compares cost a tenth of the loop
    n_ok = tl.full((BLOCK_N,), True, tl.int1) if EVEN_N else rn < N
    ri = tl.arange(0, CHUNK // 8)  # a chunk's words
    rows = tl.arange(0, 16)  # of the activations' operand
    DOT: tl.constexpr = tl.bfloat16 if ASM else tl.float32
    ones = tl.full((CHUNK // 8, BLOCK_N), 1.0, DOT)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)  # summed over its rows: s (c - z) x
    span = K // SPLIT_K
    w_cols = w_ptr + rn[None, :] * stride_wn  # the weight's words, transposed: [words, rows]
    pdl_release(PDL)
    pdl_wait(PDL)
    for k0 in range(pid_k * span, (pid_k + 1) * span, CHUNK):
        if EVEN_N:
            words = tl.load(w_cols + k0 // 8 + ri[:, None])
        else:
            words = tl.load(w_cols + k0 // 8 + ri[:, None], mask=n_ok[None, :], other=0)
        planes = _planes(words, ASM)
        sums = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for q in tl.static_range(4):
            low, high = _x_planes(x_ptr, k0, ri, rows, q, ASM)
            sums = tl.dot(low, planes[2 * q], sums)
            sums = tl.dot(high, planes[2 * q + 1], sums)
        parts = tl.load(x_ptr + k0 + 16 * rows[:, None] + ri[None, :], mask=(rows < 8)[:, None], other=0.0)
        x_sums = tl.dot(parts.to(DOT), ones, tl.zeros((16, BLOCK_N), dtype=tl.float32))
        scale = tl.load(scale_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
        if ZERO == -1:
            zero = 128.0 + tl.load(zero_ptr + rn * stride_zn + k0 // GROUP, mask=n_ok, other=0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N,), 128.0 + ZERO, tl.float32)
        acc = tl.fma(sums, (scale * 0.0625)[None, :], acc)
        acc = tl.fma(x_sums, (-zero * scale)[None, :], acc)
    total = tl.sum(acc, axis=0)
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
    whole_chunks = group > 0 and group % CHUNK.value == 0 and k % (CHUNK.value * split_k) == 0
    return whole_chunks and (split_k == 1 or -(-n // block_n) <= MAX_TILES)


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
    return [triton.Config({"MMA": True, "BLOCK_N": n, "SPLIT_K": s}, num_warps=w, num_stages=3)
            for n, w in ((128, 2), (256, 4)) for s in (1, 2, 4, 8, 16)]


def launch(config: triton.Config, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
           out: torch.Tensor, n: int, k: int, stride_wn: int, stride_sn: int, stride_zn: int, group: int,
           zero_const: int) -> None:
    """out [n] = x [k] @ W^T for int32 words `w` [n, k / 8] with `config`'s tile (`fits` it)."""
    block_n, split_k = config.kwargs["BLOCK_N"], config.kwargs["SPLIT_K"]
    if x.data_ptr() % 4:  # the kernel reads x as int32 words
        x = x.clone()
    part = torch.empty(split_k, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    count = counters(x.device) if split_k > 1 else w
    int4_mma_gemv_kernel[(triton.cdiv(n, block_n), split_k)](
        x, w, scale, zero, out, part, count, n, k, stride_wn, stride_sn, stride_zn, GROUP=group, ZERO=zero_const,
        SPLIT_K=split_k, BLOCK_N=block_n, EVEN_N=n % block_n == 0, ASM=not triton_interpreting(), num_warps=config.num_warps,
        num_stages=config.num_stages, **pdl(x.device))
