"""A dense weight's one-row product (batch-1 decode) on the one-row kernel of the quantized
weights, where it beats cuBLAS on the GPU at hand.

cuBLAS's one-row kernels read some of the H200's Llama-8B layers at 0.74-0.84 of copy bandwidth
and add a split-K reduction; others at 1.0. Which is faster depends on the shape and the GPU, so
each weight shape is timed once, at start-up (`one_row_tiles.timing_one_row_products`, entered by
the model runner around its warm-up steps), and the faster kept. A shape first met later, or while a CUDA
graph is captured, takes cuBLAS: nothing is timed in the middle of serving.
"""
from __future__ import annotations

import logging

import torch
import triton

from pagellm.ops.triton.matmul import interpreter_tile, launch_one_row, one_row_configs
from pagellm.ops.triton.one_row_tiles import (
    OneRowKey,
    choice_key,
    choose,
    replay_us,
    stored_choices,
    timing,
    uncached_copies,
)

logger = logging.getLogger(__name__)


_TILES = ((2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 2048, 4), (8, 2048, 8), (16, 1024, 4))
"""One-row tiles for a 16- or 32-bit weight: at least twice an 8-bit code's bytes, so no wider in
K than the 8-bit tiles. All are also tried with PREFETCH."""
_CONFIGS = one_row_configs(_TILES, _TILES)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One row x [1, K] @ W^T for a dense weight W [N, K] (16- or 32-bit floats, unit column
    stride) -> [1, N] in x's dtype: the one-row kernel's float32 multiply-adds, no scale."""
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1:
        raise ValueError(f"dense_gemv takes x [1, {k}] and a weight with unit column stride, not x "
                         f"{tuple(x.shape)} and a weight strided {weight.stride()}")
    x = x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    layout = dict(GROUP=0, ZERO=0, OFFSET=False, PACKED=False, PER_GROUP=False, DENSE=True)

    def run(config: triton.Config, w: torch.Tensor, compile_only: bool = False) -> None:  # w: the weight or a copy
        launch_one_row(config, n, (x, w, w, w, w, out, n, k, w.stride(0), 0, 0), compile_only, **layout)

    if not x.is_cuda:  # Triton's interpreter (the tests' small shapes): one fixed tile
        run(interpreter_tile(64), weight)
        return out
    key = OneRowKey(x.device, n, k, weight.stride(0), weight.dtype, x.dtype, None, tuple(layout.items()))
    run(choose(key, _CONFIGS, run, weight), weight)
    return out


_FASTER: dict[tuple, bool] = {}
"""Per (device, weight shape and row stride, dtypes): whether `dense_gemv` beat cuBLAS."""
FASTER_SECTION = "dense_one_row_faster"
"""The stored choices' section of `_FASTER` (`choice_cache`)."""


def dense_gemv_is_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a one-row step on this CUDA weight takes `dense_gemv` rather than cuBLAS: as timed
    at start-up (or at an earlier start: stored); cuBLAS for a shape not timed. The kernel indexes
    in int32, so a weight of 2**31 elements or more keeps cuBLAS."""
    key = (x.device, tuple(weight.shape), weight.stride(0), weight.dtype, x.dtype)
    faster = _FASTER.get(key)
    if faster is None:
        store = stored_choices(x.device)
        stored = store.get(FASTER_SECTION, choice_key(key))
        if isinstance(stored, bool):
            _FASTER[key] = stored
            return stored
        if not timing() or weight.stride(1) != 1 or weight.shape[0] * weight.stride(0) >= 2**31:
            return False
        dense_gemv(x, weight)  # its tile chosen first, on copies of its own
        weights = uncached_copies(weight)
        ours = replay_us(lambda w: dense_gemv(x, w), weights)
        cublas = replay_us(lambda w: torch.nn.functional.linear(x, w), weights)
        del weights
        _FASTER[key] = faster = ours < cublas
        store.put(FASTER_SECTION, choice_key(key), faster)
        logger.info("one-row product of a %s weight %s: the one-row kernel %.1f us, cuBLAS %.1f us: %s",
                    weight.dtype, tuple(weight.shape), ours, cublas, "kernel" if faster else "cuBLAS")
    return faster
