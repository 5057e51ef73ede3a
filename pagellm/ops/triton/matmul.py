"""x @ W^T for 8-bit and 4-bit weights, dequantized in registers: one Triton kernel for every format.

The weight stays in memory as stored (8-bit codes [N, K], or 4-bit codes two per byte [N, K / 2])
and is read once per tile of activation rows, so a decode step reads half (8-bit) or a quarter
(4-bit) of the bytes of a 16-bit weight. Each tile's product runs on the tensor cores in the
activations' dtype. A tile within one group of K multiplies the codes (minus zero points: small
integers, exact there) and applies the group's scale (and GGUF's offset, times the activations'
sum) to the float32 product; per-channel scales apply at the end. A tile of several groups (the
autotuner's choice where groups are small, e.g. GGUF's 16 and 32) dequantizes each weight in
float32 and rounds it to the activations' type, as a dense model's weights are rounded. Steps of
`DEQUANTIZE_ROWS` rows or more write the weight once in the activations' type and multiply with
cuBLAS instead (the tiles would repeat the dequantization once per tile of rows). Steps of one
row (decode at batch 1) take a GEMV on the CUDA cores, which reads 4-bit codes as int32 words of
eight.
"""
from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagellm.ops.numerics import QMAX
from pagellm.ops.triton.one_row_tiles import OneRowKey, choose
from pagellm.ops.triton.utils import pdl, pdl_release, pdl_wait


@triton.jit
def _dot(x, w, IEEE: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T in float32; float32 inputs exactly (IEEE)."""
    if IEEE:
        out = tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        out = tl.dot(x, tl.trans(w))
    return out


@triton.jit
def _exact_float(v):
    """int32 v (|v| < 2**22) -> float32, exactly, without the int-to-float conversion instruction
    (a quarter of the FMA rate: it held the one-row int8 product to 0.53-0.76 of the H200's copy
    bandwidth, 0.58-0.86 without it): v added to the bits of 1.5 * 2**23 is the float 1.5 * 2**23 + v."""
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


@triton.jit
def _dequant_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, offset_ptr, out_ptr,  # x [M, K]; the weight's layout: see dequant_matmul
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr,  # K values per scale ([N, K / GROUP]); 0: a scale per output channel ([N])
    PACKED: tl.constexpr,  # w holds two 4-bit codes a byte ([N, K / 2]); else one 8-bit code an element
    ZERO: tl.constexpr,  # subtracted from every code; -1: zero_ptr's per group (uint8 [N, K / GROUP])
    OFFSET: tl.constexpr,  # offset_ptr [N, K / GROUP] (scale's strides) is added to each weight of its group
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
        if PACKED:
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :],
                             mask=n_ok[:, None] & (rb < K // 2)[None, :], other=0)
            q = tl.interleave(packed & 0xF, packed >> 4)  # byte j holds k = 2j (low nibble) and 2j + 1
        else:
            q = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :],
                        other=0.0)
        if GROUP == 0:  # 8-bit codes, a scale per output channel (applied at the end)
            acc += _dot(x, q.to(x.dtype), IEEE)
        elif BLOCK_K <= GROUP:
            # The tile lies within one group: codes minus zero points are small integers, exact in
            # the activations' type, and the group's scale multiplies the float32 product.
            if ZERO == -1:
                zero = tl.load(zero_ptr + rn * stride_zn + k0 // GROUP, mask=n_ok, other=0)
                w = (q.to(tl.int32) - zero.to(tl.int32)[:, None]).to(x.dtype)
            elif ZERO != 0:
                w = (q.to(tl.int32) - ZERO).to(x.dtype)
            else:
                w = q.to(x.dtype)
            scale = tl.load(scale_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
            acc += _dot(x, w, IEEE) * scale[None, :]
            if OFFSET:  # sum_k x_k (c_k s + o) = s (x . c) + o sum_k x_k
                offset = tl.load(offset_ptr + rn * stride_sn + k0 // GROUP, mask=n_ok, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * offset[None, :]
        else:
            # Several groups a tile (GROUP divides BLOCK_K; deep tiles keep the tensor cores busy
            # where groups are small): each weight is dequantized in float32 and rounded to the
            # activations' type, as a dense model's weights are.
            NUM_G: tl.constexpr = BLOCK_K // GROUP
            rg = k0 // GROUP + tl.arange(0, NUM_G)
            g_mask = n_ok[:, None] & (rg < K // GROUP)[None, :]
            c = tl.reshape(_exact_float(q.to(tl.int32)), (BLOCK_N, NUM_G, GROUP))
            if ZERO == -1:
                c -= tl.load(zero_ptr + rn[:, None] * stride_zn + rg[None, :], mask=g_mask, other=0).to(
                    tl.float32)[:, :, None]
            elif ZERO != 0:
                c -= ZERO
            w = c * tl.load(scale_ptr + rn[:, None] * stride_sn + rg[None, :], mask=g_mask, other=0.0).to(
                tl.float32)[:, :, None]
            if OFFSET:
                w += tl.load(offset_ptr + rn[:, None] * stride_sn + rg[None, :], mask=g_mask, other=0.0).to(
                    tl.float32)[:, :, None]
            acc += _dot(x, tl.reshape(w, (BLOCK_N, BLOCK_K)).to(x.dtype), IEEE)
    if GROUP == 0:
        acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _load_tile(w_ptr, rn, n_ok, stride_wn, k0, K, PACKED: tl.constexpr, COLS: tl.constexpr):
    """Rows `rn` of the weight for inputs k0 .. k0 + BLOCK_K (none past K): COLS int32 words of
    eight 4-bit codes (PACKED), else COLS codes or weights."""
    if PACKED:
        rw = k0 // 8 + tl.arange(0, COLS)
        tile = tl.load(w_ptr + rn[:, None] * stride_wn + rw[None, :], mask=n_ok[:, None] & (rw < K // 8)[None, :],
                       other=0)
    else:
        rk = k0 + tl.arange(0, COLS)
        tile = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :],
                       other=0.0)
    return tile


@triton.jit
def _word_inputs(x_ptr, k0, K, COLS: tl.constexpr):
    """The inputs of a tile's COLS words of eight codes from k0: (x_0, ..., x_7), x_j [COLS] the
    input of code j of each word in float32 (0 past K), and x_col, each word's inputs' sum."""
    rw = k0 // 8 + tl.arange(0, COLS)
    w_ok = rw < K // 8
    xs = (tl.load(x_ptr + 8 * rw, mask=w_ok, other=0.0).to(tl.float32),
          tl.load(x_ptr + 8 * rw + 1, mask=w_ok, other=0.0).to(tl.float32),
          tl.load(x_ptr + 8 * rw + 2, mask=w_ok, other=0.0).to(tl.float32),
          tl.load(x_ptr + 8 * rw + 3, mask=w_ok, other=0.0).to(tl.float32),
          tl.load(x_ptr + 8 * rw + 4, mask=w_ok, other=0.0).to(tl.float32),
          tl.load(x_ptr + 8 * rw + 5, mask=w_ok, other=0.0).to(tl.float32),
          tl.load(x_ptr + 8 * rw + 6, mask=w_ok, other=0.0).to(tl.float32),
          tl.load(x_ptr + 8 * rw + 7, mask=w_ok, other=0.0).to(tl.float32))
    return xs, ((xs[0] + xs[1]) + (xs[2] + xs[3])) + ((xs[4] + xs[5]) + (xs[6] + xs[7]))


@triton.jit
def _f16_pairs(lo, hi):
    """float32 lo, hi -> one int32: the float16 pair (lo in the low half), rounded to nearest."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


def _run_ptx() -> str:
    """PTX of `_half_chunk_sums`: per word t ($1..$4), its codes' pairs p = 0..3 masked out (p >= 2
    after a shift by 8) and multiplied with input pair p of word t ($5 + 4p + t), alternately into
    two float16x2 sums (two chains in flight); the two added in float16, their halves in float32."""
    lines = [".reg .b32 v<4>, s<4>, h<2>;", ".reg .f16 l, u;", ".reg .f32 fl, fu;", "mov.b32 h0, 0;", "mov.b32 h1, 0;"]
    for t in range(4):
        word = f"${1 + t}"
        lines += [f"and.b32 v0, {word}, 0x000F000F;", f"and.b32 v1, {word}, 0x00F000F0;", f"shr.u32 s{t}, {word}, 8;",
                  f"and.b32 v2, s{t}, 0x000F000F;", f"and.b32 v3, s{t}, 0x00F000F0;"]
        lines += [f"fma.rn.f16x2 h{p % 2}, v{p}, ${5 + 4 * p + t}, h{p % 2};" for p in range(4)]
    lines += ["add.rn.f16x2 h0, h0, h1;", "mov.b32 {l, u}, h0;", "cvt.f32.f16 fl, l;", "cvt.f32.f16 fu, u;",
              "add.f32 $0, fl, fu;"]
    return "{\n" + "\n".join(lines) + "\n}"


_RUN_PTX = tl.constexpr(_run_ptx())


@triton.jit
def _half_chunk_sums(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3):
    """The sum over four words of codes w0..w3 (a row's, consecutive) of code j times its input's
    float16 y_j, in float32: a_t, b_t, c_t, d_t hold word t's inputs as pairs (y_0, y_4), (y_1, y_5),
    (y_2, y_6), (y_3, y_7), the odd ones divided by 16. A code and its partner four codes on
    (bits 4p..4p+3 and 16 higher, after a shift by 8 for p >= 2) masked out of their word are the
    float16 pair of subnormals c 2**-24 (16 c 2**-24 for odd p): one and for two codes, no
    subtraction, and one packed multiply-add (HFMA2) for two products (`_run_ptx`)."""
    return tl.inline_asm_elementwise(
        _RUN_PTX, "=f,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
        [w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3],
        dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _split4(v, R: tl.constexpr, C: tl.constexpr):
    """[R, 4C] -> its four interleaved parts [R, C] (columns 4i, 4i + 1, 4i + 2, 4i + 3)."""
    a, b = tl.split(tl.reshape(v, (R, C, 2, 2)))
    v0, v2 = tl.split(a)
    v1, v3 = tl.split(b)
    return v0, v1, v2, v3


@triton.jit
def _row(v, C: tl.constexpr):
    """[C, 1] -> [1, C]."""
    return tl.reshape(v, (1, C))


@triton.jit
def _run_inputs(x_ptr, runs, t, K):
    """Word t's eight inputs of each run [R] (0 past K), [R, 8] in float32."""
    words = runs * 4 + t
    ok = words < K // 8
    return tl.load(x_ptr + words[:, None] * 8 + tl.arange(0, 8)[None, :], mask=ok[:, None], other=0.0).to(tl.float32)


@triton.jit
def _word_pairs(xw, up):
    """[R, 8] inputs of a word each run, its scale up [R] -> [R, 4] float16 pairs (x_p, x_p+4) * up,
    the odd p's divided by 16 (their codes sit four bits up)."""
    lo, hi = tl.split(tl.permute(tl.reshape(xw, (xw.shape[0], 2, 4)), (0, 2, 1)))
    scale = up[:, None] * tl.where(tl.arange(0, 4) % 2 == 1, 0.0625, 1.0)[None, :]
    return _f16_pairs(lo * scale, hi * scale)


@triton.jit
def _run_scales(big):
    """Each run's largest |input| -> (up, unscale): from its biased exponent e (clamped: all-zero
    inputs, and infinities, stay finite here), inputs times up = 2**(141 - e), the sums back by
    unscale = 2**(e - 117) (2**24 for the subnormals)."""
    e = tl.minimum(tl.maximum(big.to(tl.int32, bitcast=True) >> 23, 14), 244)
    return ((268 - e) << 23).to(tl.float32, bitcast=True), ((e + 10) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _thread_run_pairs(x_ptr, k0, K, C4: tl.constexpr):
    """`_half_tile_sums`'s inputs for THREAD_RUNS, a run a thread (no exchange between threads): each
    run's 32 inputs read (16 bytes a word) where its words are multiplied, and returned as the four
    words' float16 pairs (`_word_pairs`, [C4, 4] each), the run's unscale [C4] (`_run_scales`) and
    its inputs' sum [C4]."""
    runs = k0 // 32 + tl.arange(0, C4)
    xw0 = _run_inputs(x_ptr, runs, 0, K)
    xw1 = _run_inputs(x_ptr, runs, 1, K)
    xw2 = _run_inputs(x_ptr, runs, 2, K)
    xw3 = _run_inputs(x_ptr, runs, 3, K)
    big = tl.maximum(tl.maximum(tl.max(tl.abs(xw0), axis=1), tl.max(tl.abs(xw1), axis=1)),
                     tl.maximum(tl.max(tl.abs(xw2), axis=1), tl.max(tl.abs(xw3), axis=1)))
    up, unscale = _run_scales(big)
    x_run = (tl.sum(xw0, axis=1) + tl.sum(xw1, axis=1)) + (tl.sum(xw2, axis=1) + tl.sum(xw3, axis=1))
    return _word_pairs(xw0, up), _word_pairs(xw1, up), _word_pairs(xw2, up), _word_pairs(xw3, up), unscale, x_run


@triton.jit
def _half_tile_sums(w, k0, x_ptr, K, BLOCK_N: tl.constexpr, COLS: tl.constexpr, THREAD_RUNS: tl.constexpr):
    """The 4-bit products of one tile of words w [BLOCK_N, COLS] in float16 (HALF): [BLOCK_N, COLS / 4]
    sums, each over a run of four words (32 inputs), and x_col, each word's inputs' sum. Each run's
    inputs are scaled by a power of two that brings its largest to [2**14, 2**15) (2**-24 times a
    code, at most 15 * 2**-9: the float16 sums of 16 products never overflow, and an outlier
    input coarsens only its own run), rounded once to float16. Each product rounds to 11 bits (or,
    below float16's normal range, to 2**-25, that is 2**-15 of the run's largest input), and so does
    each of the run's float16 sums; the run's sum is scaled back in float32. THREAD_RUNS: the same
    products, each run's inputs read and scaled by the thread that multiplies its words (for tiles
    of one run a thread), and x_col each run's inputs' sum."""
    C4: tl.constexpr = COLS // 4
    w0, w1, w2, w3 = _split4(w, BLOCK_N, C4)
    if THREAD_RUNS:
        p0, p1, p2, p3, unscale, x_col = _thread_run_pairs(x_ptr, k0, K, C4)
        a0, b0, c0, d0 = _split4(p0, C4, 1)
        a1, b1, c1, d1 = _split4(p1, C4, 1)
        a2, b2, c2, d2 = _split4(p2, C4, 1)
        a3, b3, c3, d3 = _split4(p3, C4, 1)
        prod = _half_chunk_sums(w0, w1, w2, w3, _row(a0, C4), _row(a1, C4), _row(a2, C4), _row(a3, C4),
                                _row(b0, C4), _row(b1, C4), _row(b2, C4), _row(b3, C4), _row(c0, C4), _row(c1, C4),
                                _row(c2, C4), _row(c3, C4), _row(d0, C4), _row(d1, C4), _row(d2, C4), _row(d3, C4))
    else:
        xs, x_col = _word_inputs(x_ptr, k0, K, COLS)
        x0, x1, x2, x3, x4, x5, x6, x7 = xs
        big = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                         tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
        up_run, unscale = _run_scales(tl.max(tl.reshape(big, (C4, 4)), axis=1))
        up = tl.reshape(tl.broadcast_to(up_run[:, None], (C4, 4)), (COLS,))
        up16 = up * 0.0625  # odd pairs: their codes sit four bits up (16 c)
        a0, a1, a2, a3 = _split4(_f16_pairs(x0 * up, x4 * up)[None, :], 1, C4)
        b0, b1, b2, b3 = _split4(_f16_pairs(x1 * up16, x5 * up16)[None, :], 1, C4)
        c0, c1, c2, c3 = _split4(_f16_pairs(x2 * up, x6 * up)[None, :], 1, C4)
        d0, d1, d2, d3 = _split4(_f16_pairs(x3 * up16, x7 * up16)[None, :], 1, C4)
        prod = _half_chunk_sums(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3)
    return prod * unscale[None, :], x_col


@triton.jit
def _tile_sums(w, k0, acc, acc_groups, x_sum, x_ptr, rn, n_ok, scale_ptr, zero_ptr, offset_ptr, K, stride_sn,
               stride_zn, GROUP: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr, PACKED: tl.constexpr,
               PER_GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HALF: tl.constexpr,
               THREAD_RUNS: tl.constexpr):
    """`_gemv_kernel`'s sums over one tile `w` (from `_load_tile`) of inputs k0 .. k0 + BLOCK_K:
    (acc, acc_groups, x_sum) updated. For 8-bit codes and dense weights without groups, acc holds
    [BLOCK_N, S] partial sums, each of a run of BLOCK_K / S inputs in every tile."""
    COLS: tl.constexpr = BLOCK_K // 8 if PACKED else BLOCK_K  # columns of a tile's codes
    UNSCALE: tl.constexpr = 79228162514264337593543950336.0 if PACKED and not HALF else 1.0  # 2**96 (below)
    NUM_G: tl.constexpr = BLOCK_K // GROUP if PER_GROUP else 1  # groups a tile
    if HALF:
        prod, x_col = _half_tile_sums(w, k0, x_ptr, K, BLOCK_N, COLS, THREAD_RUNS)
    elif PACKED:
        # A code at bits s..s+3 (s < 20), the word's other bits cleared, is the float c 2**(s - 149)
        # exactly: a subnormal, with no implicit leading 1 to subtract. The input carries
        # 2**(53 - s), so their product is c x 2**-96, rounded once as c x would be, and the sums
        # are scaled back by 2**96 (UNSCALE). One and a code; the top three codes are shifted
        # down once a word first (bits 20..31 to 8..19). This needs float32 multiplies that keep
        # subnormals (they do in Triton's CUDA code and its interpreter; flushed, every code
        # would read 0). Exact for |x| from 2**-30 to 2**75; below, a product errs by at most
        # 2**-54; from 2**75 the scaled input overflows. A column of `prod` is a word's eight
        # inputs, `x_col` their sum.
        words = w
        high = words >> 12
        prod = tl.zeros((BLOCK_N, COLS), dtype=tl.float32)
        xs, x_col = _word_inputs(x_ptr, k0, K, COLS)
        for j in tl.static_range(8):
            x_j = xs[j]
            if j < 5:
                bits = words & (0xF << (4 * j))
                y = x_j * (2.0 ** (53 - 4 * j))
            else:
                bits = high & (0xF << (4 * j - 12))
                y = x_j * (2.0 ** (65 - 4 * j))
            prod += bits.to(tl.float32, bitcast=True) * y[None, :]
    else:
        rk = k0 + tl.arange(0, BLOCK_K)
        x_col = tl.load(x_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        if w.dtype == tl.int8:
            prod = _exact_float(w.to(tl.int32)) * x_col[None, :]
        else:  # float8 (one conversion instruction per two values), or a dense weight
            prod = w.to(tl.float32) * x_col[None, :]
    if GROUP == 0 and not PACKED:
        acc += tl.sum(tl.reshape(prod, (BLOCK_N, acc.shape[1], BLOCK_K // acc.shape[1])), axis=2)
    elif GROUP == 0:
        acc += tl.sum(prod, axis=1) * UNSCALE
    elif PER_GROUP:
        # (c - zero) s . x + o sum(x) = s (c . x - zero sum(x)) + o sum(x) per group: the zero
        # point and offset leave the inner sums; one reduction per group.
        SUMS: tl.constexpr = COLS // 4 if HALF else COLS  # prod's columns
        dot = tl.sum(tl.reshape(prod, (BLOCK_N, NUM_G, SUMS // NUM_G)), axis=2) * UNSCALE  # [BLOCK_N, NUM_G]
        # x_col: the inputs', words' or runs' sums (by layout); a group holds whole ones.
        group_sum = tl.sum(tl.reshape(x_col, (NUM_G, x_col.shape[0] // NUM_G)), axis=1)[None, :]
        rg = k0 // GROUP + tl.arange(0, NUM_G)
        g_mask = n_ok[:, None] & (rg < K // GROUP)[None, :]
        if ZERO == -1:
            zero = tl.load(zero_ptr + rn[:, None] * stride_zn + rg[None, :], mask=g_mask, other=0)
            dot -= zero.to(tl.float32) * group_sum
        elif ZERO != 0:
            dot -= ZERO * group_sum
        scale = tl.load(scale_ptr + rn[:, None] * stride_sn + rg[None, :], mask=g_mask, other=0.0)
        dot *= scale.to(tl.float32)
        if OFFSET:
            offset = tl.load(offset_ptr + rn[:, None] * stride_sn + rg[None, :], mask=g_mask, other=0.0)
            dot += offset.to(tl.float32) * group_sum
        acc_groups += dot
    else:
        acc += tl.sum(prod, axis=1) * UNSCALE
        x_sum += tl.sum(x_col, axis=0)
    return acc, acc_groups, x_sum


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, offset_ptr, out_ptr,  # one activation row x [K]; the rest as above
    N, K, stride_wn, stride_sn, stride_zn,
    GROUP: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,  # as above
    PACKED: tl.constexpr,  # 4-bit codes, w_ptr viewed as int32 words of eight ([N, K / 8]), groups of whole words
    PER_GROUP: tl.constexpr,  # BLOCK_K holds whole groups (else one group spans the row: scaled at the end)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr = False,  # load each tile one tile ahead (more registers, fewer stalls)
    DENSE: tl.constexpr = False,  # w holds the weights themselves (16- or 32-bit floats, GROUP 0): no scale
    PDL: tl.constexpr = False,  # see `pdl`: with PREFETCH, the first tile is read before waiting for x
    HALF: tl.constexpr = False,  # 4-bit codes multiplied in float16 pairs (`_half_tile_sums`; compiled only)
    THREAD_RUNS: tl.constexpr = False,  # with HALF: each thread makes its own runs' pairs (`_half_tile_sums`)
):
    # A decode step's one row: multiply-adds on the CUDA cores, no tile padded to 16 rows. 4-bit
    # codes arrive as int32 words of eight (k = 8i + j in word i's bits 4j..4j+3, as the bytes
    # hold them), so that turning a code into a float costs one integer operation: the kernel is
    # bound by its instructions more than by memory (docs/performance-notes.md has the
    # measured steps, `benchmarks/gemv_sass.py` counts the instructions).
    tl.static_assert(HALF or not THREAD_RUNS, "THREAD_RUNS is a way of the float16 (HALF) products")
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    COLS: tl.constexpr = BLOCK_K // 8 if PACKED else BLOCK_K  # columns of a tile's codes
    if GROUP == 0 and not PACKED:
        # A partial sum per run of one 16-byte load's weights: the runs are a thread's own, so
        # the sums across threads (shuffles, and a barrier between warps), which cost the tiles a
        # fifth of their instructions each time round, wait for the end of the loop.
        RUNS: tl.constexpr = BLOCK_K * w_ptr.dtype.element_ty.primitive_bitwidth // 128
        tl.static_assert(RUNS > 0, "a one-row tile spans at least one 16-byte load of a row")
        acc = tl.zeros((BLOCK_N, RUNS), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    x_sum = tl.zeros((1,), dtype=tl.float32)
    NUM_G: tl.constexpr = BLOCK_K // GROUP if PER_GROUP else 1  # groups a tile
    acc_groups = tl.zeros((BLOCK_N, NUM_G), dtype=tl.float32)
    pdl_release(PDL)
    if PREFETCH:  # each tile loaded a tile ahead, in flight while the one before is summed
        next_w = _load_tile(w_ptr, rn, n_ok, stride_wn, 0, K, PACKED, COLS)
    pdl_wait(PDL)
    for k0 in range(0, K, BLOCK_K):
        if PREFETCH:
            w = next_w
            next_w = _load_tile(w_ptr, rn, n_ok, stride_wn, k0 + BLOCK_K, K, PACKED, COLS)
        else:
            w = _load_tile(w_ptr, rn, n_ok, stride_wn, k0, K, PACKED, COLS)
        acc, acc_groups, x_sum = _tile_sums(w, k0, acc, acc_groups, x_sum, x_ptr, rn, n_ok, scale_ptr, zero_ptr,
                                            offset_ptr, K, stride_sn, stride_zn, GROUP, ZERO, OFFSET, PACKED,
                                            PER_GROUP, BLOCK_N, BLOCK_K, HALF, THREAD_RUNS)
    if PER_GROUP:
        acc = tl.sum(acc_groups, axis=1)
    elif GROUP == 0:
        if not PACKED:
            acc = tl.sum(acc, axis=1)
        if not DENSE:
            acc *= tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    else:  # one group a row (the dispatcher sends no offset here)
        if ZERO == -1:
            acc -= tl.load(zero_ptr + rn * stride_zn, mask=n_ok, other=0).to(tl.float32) * x_sum
        elif ZERO != 0:
            acc -= ZERO * x_sum
        acc *= tl.load(scale_ptr + rn * stride_sn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _dequantize_kernel(
    w_ptr, scale_ptr, zero_ptr, offset_ptr, out_ptr,  # the weight's layout as above; out [N, K]
    N, K, stride_wn, stride_sn, stride_zn, stride_on,
    GROUP: tl.constexpr, PACKED: tl.constexpr, ZERO: tl.constexpr, OFFSET: tl.constexpr,  # as above
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_K holds whole groups or lies within one
):
    # The weight in the activations' type, for cuBLAS: large steps are bound by the tensor cores,
    # where dequantizing in every tile of rows would repeat the work once per tile. A group's scale
    # (zero point, offset) is loaded once and broadcast over its codes: loaded per code, the
    # gathers held this kernel to a sixth of the copy bandwidth on the H200 (now 0.7).
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_ok = rn < N
    ok = n_ok[:, None] & (rk < K)[None, :]
    if PACKED:
        rb = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rn[:, None] * stride_wn + rb[None, :], mask=n_ok[:, None] & (rb < K // 2)[None, :],
                         other=0)
        q = tl.interleave(packed & 0xF, packed >> 4)
    else:
        q = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=ok, other=0.0)
    if GROUP == 0:
        w = q.to(tl.float32) * tl.load(scale_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    else:
        NUM_G: tl.constexpr = BLOCK_K // GROUP if BLOCK_K >= GROUP else 1  # groups in the tile
        SPAN: tl.constexpr = BLOCK_K // NUM_G  # codes of one group in the tile
        rg = (tl.program_id(1) * BLOCK_K) // GROUP + tl.arange(0, NUM_G)
        g_ok = n_ok[:, None] & (rg < K // GROUP)[None, :]
        c = tl.reshape(_exact_float(q.to(tl.int32)), (BLOCK_N, NUM_G, SPAN))
        if ZERO == -1:
            zero = tl.load(zero_ptr + rn[:, None] * stride_zn + rg[None, :], mask=g_ok, other=0)
            c -= zero.to(tl.float32)[:, :, None]
        elif ZERO != 0:
            c -= ZERO
        g = rn[:, None] * stride_sn + rg[None, :]
        w = c * tl.load(scale_ptr + g, mask=g_ok, other=0.0).to(tl.float32)[:, :, None]
        if OFFSET:
            w += tl.load(offset_ptr + g, mask=g_ok, other=0.0).to(tl.float32)[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
    tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, QMAX: tl.constexpr, INT: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Row r of x [M, K] -> q (fp8 or int8) and scale[r] = max |x_r| / QMAX: one program a row."""
    row = tl.program_id(0)
    rk = tl.arange(0, BLOCK)
    ok = rk < K
    x = tl.load(x_ptr + row * stride_x + rk, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / QMAX
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
    if INT:
        q = libdevice.rint(q)  # half to even, as torch.round
    tl.store(q_ptr + row * stride_q + rk, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def _dot_configs() -> list[triton.Config]:
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
            for n, k, w, s in ((32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (128, 64, 8, 3),
                               (128, 128, 8, 3), (64, 32, 4, 4))]


def _gemv_configs(int4: bool) -> list[triton.Config]:
    """The one-row tiles `one_row_tiles.choose` times: each was the fastest on one of the H200's Llama-8B layers in
    a sweep of benchmarks/gemv_sweep.py (for 4-bit, some only before the kernel lost instructions:
    a later sweep may prune them); their tiles with PREFETCH were added without a sweep. The float16
    ones (HALF: two codes an instruction, `benchmarks/gemv_sass.py --half`) are those within 6% of
    the fastest on some layer in an H100's sweep of 50 (`gemv_sweep --phases one_row`,
    gemv_sweep_h100_20261206T063508Z_8f7efc1_one_row_split.json; a tile fastest on one layer is up
    to 45% slower on another), then float16 ones with THREAD_RUNS (9-22% fewer instructions a code
    at these tiles, `gemv_sass --half --thread-runs`; taken by qkv, o and down on an H100)."""
    if not int4:
        tiles = ((4, 2048, 4), (4, 4096, 4), (8, 2048, 4), (8, 2048, 8), (8, 4096, 4), (2, 2048, 4))
        return one_row_configs(tiles, tiles[:3])
    return one_row_configs(((16, 2048, 4), (16, 2048, 8), (8, 2048, 4), (16, 1024, 4), (32, 2048, 4), (32, 1024, 4),
                            (16, 4096, 4)), ((16, 1024, 4), (8, 2048, 4), (32, 1024, 4), (16, 2048, 4))) + \
        one_row_configs(((16, 1024, 4), (16, 2048, 8), (16, 2048, 4)),
                        ((16, 4096, 8), (16, 2048, 8), (32, 2048, 8), (16, 4096, 4), (8, 2048, 4), (32, 1024, 4),
                         (8, 2048, 8)), half=True) + \
        one_row_configs(((16, 4096, 4), (32, 4096, 4), (8, 4096, 4)), ((16, 4096, 4), (8, 4096, 4)), half=True,
                        thread_runs=True)


def one_row_configs(tiles: tuple, prefetch_tiles: tuple, half: bool = False,
                    thread_runs: bool = False) -> list[triton.Config]:
    """The one-row kernel's (BLOCK_N, BLOCK_K, warps) tiles without PREFETCH, then those with it.
    THREAD_RUNS (with HALF) only where `thread_runs_fit`."""
    assert not thread_runs or all(thread_runs_fit(k, w) for some in (tiles, prefetch_tiles) for _, k, w in some)
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PREFETCH": p, "HALF": half, "THREAD_RUNS": thread_runs},
                          num_warps=w, num_stages=3)
            for p, some in ((False, tiles), (True, prefetch_tiles)) for n, k, w in some]


def thread_runs_fit(block_k: int, warps: int) -> bool:
    """Whether a tile's runs of 32 inputs are at least its threads, as THREAD_RUNS needs: with
    fewer, Triton repeats the tile's words across threads (`gemv_sass --half --thread-runs`)."""
    return block_k >= 1024 * warps


def _fits_group(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """A tile lies within one group of K or holds whole groups."""
    group = named_args.get("GROUP", kwargs.get("GROUP", 0))
    return _nonempty([c for c in configs if group == 0 or group % c.kwargs["BLOCK_K"] == 0
                      or c.kwargs["BLOCK_K"] % group == 0], group)


def _nonempty(configs: list[triton.Config], group: int) -> list[triton.Config]:
    if not configs:  # a tile across two groups would take one group's scale for both
        raise ValueError(f"no tile fits groups of {group} input features (a power of two from 16, or a multiple "
                         "of 32, is needed)")
    return configs


_LAYOUT_KEY = ["GROUP", "PACKED", "ZERO", "OFFSET"]
# Triton keeps the timed choice beside its compiled kernels (TRITON_CACHE_DIR, the cache folder's
# `triton`: `pagellm.config.cache_dirs`), so a later start on the same GPU skips the timing.
_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
"""A Triton whose autotuner takes `cache_results` stores its results; an older one times at each start."""
_tuned_kernel = triton.autotune(configs=_dot_configs(), key=["N", "K", "BLOCK_M", *_LAYOUT_KEY],
                                prune_configs_by={"early_config_prune": _fits_group},
                                **_CACHE_RESULTS)(_dequant_matmul_kernel)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA: x [M, K] -> (q [M, K] in `dtype`, scale [M] float32), each row scaled so that its
    largest magnitude is the type's largest value; one kernel for what takes five in PyTorch."""
    x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=dtype, device=x.device)
    scale = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(rows,)](x, q, scale, k, x.stride(0), q.stride(0), QMAX=QMAX[dtype],
                                       INT=dtype == torch.int8, BLOCK=block, num_warps=min(16, max(4, block // 1024)))
    return q, scale


DEQUANTIZE_ROWS = 128
"""Steps of at least this many rows dequantize the whole weight once and multiply with cuBLAS. On
the H200's Llama-8B layers (benchmarks/results/gemv_sweep_h200_*_large.json), summed over the four
projections: at 64 rows the tiled kernel takes 0.66-0.84x the time of dequantizing and cuBLAS (int4
groups of 128, Q4_K-like, Q8_0-like layouts), at 128 rows 1.26x and 1.10x for the 4-bit layouts
and 0.90x for Q8_0's, at 256 rows 1.6-2.3x."""


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | int = 0, group_size: int = 0,
                      offset: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The weight W [N, K] in `dtype` (layout and arguments as `dequant_matmul`'s): each value
    computed in float32, then rounded."""
    _check_offset(offset, scale)
    n = weight.shape[0]
    k = weight.shape[1] * (2 if weight.dtype == torch.uint8 else 1)
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    zero_arg, zero_const = _zero_args(zero, scale)
    block_n, block_k = 32, 128
    if 0 < group_size < k and block_k % group_size and group_size % block_k:  # a tile within one group
        block_k = group_size & -group_size  # its largest power-of-two divisor
        if block_k < 2:
            raise ValueError(f"groups of {group_size} input features (an odd number) do not split into tiles")
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, scale, zero_arg, scale if offset is None else offset, out, n, k, weight.stride(0),
        scale.stride(0), zero_arg.stride(0), out.stride(0), GROUP=group_size, PACKED=weight.dtype == torch.uint8,
        ZERO=zero_const, OFFSET=offset is not None, BLOCK_N=block_n, BLOCK_K=block_k)
    return out


def block_m(rows: int) -> int:
    """Activation rows per tile: a decode step's few rows pad to 16 (the tensor cores' least)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128


def dequant_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | int = 0,
                   group_size: int = 0, offset: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype, W dequantized from codes c in registers:
    W = (c - zero) * scale (+ offset), with a scale (and zero point, offset) per group of
    `group_size` input features ([N, K / group_size]), or per output channel ([N]) for group 0.

    `weight`: uint8 [N, K / 2], two 4-bit codes a byte (k = 2j in byte j's low nibble, 2j + 1 in
    its high one); or one 8-bit code an element, [N, K] (int8 or float8_e4m3fn). `zero`: uint8
    [N, K / group_size], or one integer for every group. `offset`: [N, K / group_size], strided
    as `scale` (GGUF's block minimums). `out`: where to write ([M, N] with unit column stride,
    e.g. some columns of a wider output); default a new tensor.
    """
    rows, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    if out is None:
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    elif out.shape != (rows, n) or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {n}] with unit column stride, not {tuple(out.shape)} "
                         f"strided {out.stride()}")
    if rows == 0:
        return out
    per_group = _whole_group_tiles(group_size)
    if (isinstance(zero, torch.Tensor) or zero or offset is not None) and not group_size:
        raise ValueError("zero points and offsets go with groups of K (group_size > 0)")
    _check_offset(offset, scale)
    if offset is not None and not per_group:
        raise ValueError(f"offsets need groups of a power of two up to 256 input features, not {group_size}")
    zero_arg, zero_const = _zero_args(zero, scale)
    layout = dict(GROUP=group_size, PACKED=weight.dtype == torch.uint8, ZERO=zero_const, OFFSET=offset is not None)
    pointers = (x, weight, scale, zero_arg, scale if offset is None else offset, out)
    if rows == 1 and (group_size == 0 or per_group or group_size == k) and _gemv_reads(weight, group_size):
        _gemv(pointers, n, k, weight.stride(0), scale.stride(0), zero_arg.stride(0), layout, per_group)
        return out
    if rows >= DEQUANTIZE_ROWS:
        return torch.mm(x, dequantize_weight(weight, scale, zero, group_size, offset, x.dtype).t(), out=out)
    bm = block_m(rows)
    args = (*pointers, rows, n, k, x.stride(0), weight.stride(0), scale.stride(0), zero_arg.stride(0), out.stride(0))
    if x.is_cuda:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(rows, bm))  # noqa: E731
        _tuned_kernel[grid](*args, **layout, IEEE=x.dtype == torch.float32, BLOCK_M=bm)
    else:  # Triton's interpreter (TRITON_INTERPRET=1): the tests' small shapes, one fixed tile
        block_k = 64 if rows > 16 else 32  # both tile kinds: within a group, or several groups
        if group_size and group_size % block_k and block_k % group_size:
            block_k = 32
        grid = (triton.cdiv(n, 16), triton.cdiv(rows, bm))
        _dequant_matmul_kernel[grid](*args, **layout, IEEE=x.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=16,
                                     BLOCK_K=block_k)
    return out


def _check_offset(offset: torch.Tensor | None, scale: torch.Tensor) -> None:
    if offset is not None and (offset.shape != scale.shape or offset.stride() != scale.stride()):
        raise ValueError("offset must have scale's shape and strides")


def _zero_args(zero: torch.Tensor | int, scale: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(pointer, ZERO): per-group zero points, or one constant (the pointer then unused)."""
    return (zero, -1) if isinstance(zero, torch.Tensor) else (scale, zero)


def _whole_group_tiles(group_size: int) -> bool:
    """Whether one-row tiles hold whole groups (a power of two up to 256); else the GEMV takes
    only a layer of one group a row (scaled at the end), and other layers the tiled kernel."""
    return 0 < group_size <= 256 and group_size & (group_size - 1) == 0


def _gemv_reads(weight: torch.Tensor, group_size: int) -> bool:
    """Whether the one-row kernel can read 4-bit codes as int32 words: rows of whole, aligned
    words, groups of whole words."""
    return weight.dtype != torch.uint8 or (
        group_size % 8 == 0 and weight.stride(1) == 1 and weight.shape[1] % 4 == 0 and weight.stride(0) % 4 == 0
        and weight.storage_offset() % 4 == 0 and weight.data_ptr() % 4 == 0)


def _gemv(pointers: tuple[torch.Tensor, ...], n: int, k: int, stride_wn: int, stride_sn: int, stride_zn: int,
          layout: dict, per_group: bool) -> None:
    x, weight, *rest = pointers
    if layout["PACKED"]:  # eight codes an int32 word
        weight = weight.view(torch.int32)
        stride_wn = weight.stride(0)
    constants = dict(**layout, PER_GROUP=per_group)

    def run(config: triton.Config, w: torch.Tensor, compile_only: bool = False) -> None:  # w: the weight or a copy
        launch_one_row(config, n, (x, w, *rest, n, k, w.stride(0), stride_sn, stride_zn), compile_only,
                       **constants)

    if not x.is_cuda:  # Triton's interpreter (the tests' small shapes): one fixed tile
        run(interpreter_tile(max(64, layout["GROUP"]) if per_group else 64), weight)
        return
    key = OneRowKey(x.device, n, k, stride_wn, weight.dtype, x.dtype, rest[0].dtype, tuple(constants.items()))
    run(choose(key, one_row_candidates(constants, x.dtype, x.device), run, weight), weight)


def one_row_candidates(constants: dict, x_dtype: torch.dtype, device: torch.device) -> tuple[triton.Config, ...]:
    """The one-row tiles for a layout (`_gemv`'s constants) and activations of `x_dtype` on `device`:
    with PER_GROUP, those of whole groups; the float16 ones (HALF) for 16-bit activations only (float32
    models keep float32 products), groups of whole runs of four words, and GPUs that pack two float32
    into float16 in one instruction (compute capability 8.0 and up). Where they apply, only they: on
    an H100 every layer's fastest float32 tile was 2-11% slower than its fastest float16 one (the
    start-up log of quant_gpu_h100_20261206T051448Z_17aec8c_half_tiles.log)."""
    return _one_row_candidates(constants["PACKED"], constants["GROUP"], constants["PER_GROUP"],
                               x_dtype.itemsize == 2 and _packs_float16(device))


@functools.cache
def _packs_float16(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


@functools.cache
def _one_row_candidates(packed: bool, group: int, per_group: bool, float16_products: bool
                        ) -> tuple[triton.Config, ...]:
    """`one_row_candidates`, computed once a layout."""
    half = float16_products and packed and group % 32 == 0
    return tuple(_nonempty([c for c in _gemv_configs(packed) if (not per_group or c.kwargs["BLOCK_K"] % group == 0)
                            and c.kwargs["HALF"] == half], group))


def interpreter_tile(block_k: int) -> triton.Config:
    """The one tile the one-row kernel takes under Triton's interpreter (the tests' small shapes)."""
    return triton.Config({"BLOCK_N": 16, "BLOCK_K": block_k})


def launch_one_row(config: triton.Config, n: int, args: tuple, compile_only: bool = False,
                   **constants: object) -> None:
    """`_gemv_kernel` over n outputs with the given tile (`one_row_tiles.choose`'s), under
    programmatic dependent launch where the GPU has it; `compile_only`: compiled (Triton's
    `warmup`), not launched."""
    grid = (triton.cdiv(n, config.kwargs["BLOCK_N"]),)
    options = dict(**constants, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages,
                   **pdl(args[0].device))
    if compile_only:
        _gemv_kernel.warmup(*args, grid=grid, **options)
    else:
        _gemv_kernel[grid](*args, **options)
