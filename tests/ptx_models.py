"""Triton stand-ins for the float16 one-row tiles' two pieces of inline PTX, so that Triton's CPU
interpreter can run those tiles: `f16_pairs` as `triton_matmul._f16_pairs` writes it, and
`half_chunk_sums` as `triton_matmul._run_ptx` computes (codes masked out of their words as the
float16 subnormals c 2**-24, 16 c 2**-24 for odd pairs, times their pairs), but in float32. They
check what the tiles hand the PTX; `test_one_row_float16_run_ptx_pairs_each_code_with_its_own_input`
checks the PTX itself."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def f16_pairs(lo, hi):
    """float32 lo, hi -> one int32: the float16 pair (lo in the low half)."""
    low = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return low | ((hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16)


@triton.jit
def _half(pair, HIGH: tl.constexpr):
    bits = (pair >> 16) & 0xFFFF if HIGH else pair & 0xFFFF
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _code(word, j: tl.constexpr):
    return ((word >> (4 * j)) & 0xF).to(tl.float32)


@triton.jit
def _word_sum(w, a, b, c, d):
    return (_code(w, 0) * _half(a, False) + _code(w, 4) * _half(a, True)
            + 16.0 * (_code(w, 1) * _half(b, False) + _code(w, 5) * _half(b, True))
            + _code(w, 2) * _half(c, False) + _code(w, 6) * _half(c, True)
            + 16.0 * (_code(w, 3) * _half(d, False) + _code(w, 7) * _half(d, True)))


@triton.jit
def half_chunk_sums(w0, w1, w2, w3, a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3):
    """The sum over four words of each code times its input, times 2**-24 (`_half_chunk_sums`)."""
    return (_word_sum(w0, a0, b0, c0, d0) + _word_sum(w1, a1, b1, c1, d1) + _word_sum(w2, a2, b2, c2, d2)
            + _word_sum(w3, a3, b3, c3, d3)) * 5.9604644775390625e-08
