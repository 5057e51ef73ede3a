"""A dense weight's one-row product (batch-1 decode) on the one-row kernel of the quantized
weights, where it beats cuBLAS on the GPU at hand.

cuBLAS's one-row kernels read some of the H200's Llama-8B layers at 0.74-0.84 of copy bandwidth
and add a split-K reduction; others at 1.0. Which is faster depends on the shape and the GPU, so
each weight shape is timed once, at start-up (`timing_one_row_products`, entered by the model
runner around its warm-up steps), and the faster kept. A shape first met later, or while a CUDA
graph is captured, takes cuBLAS: nothing is timed in the middle of serving.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
import triton
import triton.testing

from pagellm.ops.triton_utils import pdl
from pagellm.quantization.triton_matmul import _gemv_kernel, one_row_configs

logger = logging.getLogger(__name__)


_TILES = ((2, 2048, 4), (4, 1024, 4), (4, 2048, 4), (8, 1024, 4), (8, 2048, 4), (8, 2048, 8), (16, 1024, 4))
"""One-row tiles for a 16- or 32-bit weight: at least twice an 8-bit code's bytes, so no wider in
K than the 8-bit tiles. All are also tried with PREFETCH."""
_tuned = triton.autotune(configs=one_row_configs(_TILES, _TILES), key=["N", "K"])(_gemv_kernel)


def dense_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One row x [1, K] @ W^T for a dense weight W [N, K] (16- or 32-bit floats, unit column
    stride) -> [1, N] in x's dtype: the one-row kernel's float32 multiply-adds, no scale."""
    n, k = weight.shape
    if x.shape != (1, k) or weight.stride(1) != 1:
        raise ValueError(f"dense_gemv takes x [1, {k}] and a weight with unit column stride, not x "
                         f"{tuple(x.shape)} and a weight strided {weight.stride()}")
    x = x.contiguous()
    out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    args = (x, weight, weight, weight, weight, out, n, k, weight.stride(0), 0, 0)
    layout = dict(GROUP=0, ZERO=0, OFFSET=False, PACKED=False, PER_GROUP=False, DENSE=True)
    if not x.is_cuda:  # Triton's interpreter (the tests' small shapes): one fixed tile
        _gemv_kernel[(triton.cdiv(n, 16),)](*args, **layout, BLOCK_N=16, BLOCK_K=64)
    else:
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **layout, **pdl(x.device))
    return out


_FASTER: dict[tuple, bool] = {}
"""Per (device, weight shape and row stride, dtypes): whether `dense_gemv` beat cuBLAS."""
_timing = False


@contextlib.contextmanager
def timing_one_row_products() -> Iterator[None]:
    """Within the block, a one-row product of a weight shape not yet timed is timed (start-up's
    warm-up steps, outside graph capture)."""
    global _timing
    _timing = True
    try:
        yield
    finally:
        _timing = False


def dense_gemv_is_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a one-row step on this CUDA weight takes `dense_gemv` rather than cuBLAS: as timed
    at start-up; cuBLAS for a shape not timed. The kernel indexes in int32, so a weight of 2**31
    elements or more keeps cuBLAS."""
    key = (x.device, tuple(weight.shape), weight.stride(0), weight.dtype, x.dtype)
    faster = _FASTER.get(key)
    if faster is None:
        if not _timing or torch.cuda.is_current_stream_capturing() or weight.stride(1) != 1 \
                or weight.shape[0] * weight.stride(0) >= 2**31:
            return False
        weights = _uncached_copies(weight)
        ours = _replay_us(lambda w: dense_gemv(x, w), weights)
        cublas = _replay_us(lambda w: torch.nn.functional.linear(x, w), weights)
        del weights
        _FASTER[key] = faster = ours < cublas
        logger.info("one-row product of a %s weight %s: the one-row kernel %.1f us, cuBLAS %.1f us: %s",
                    weight.dtype, tuple(weight.shape), ours, cublas, "kernel" if faster else "cuBLAS")
    return faster


def _uncached_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and as many copies as make twice the L2 cache: read in turn, each comes from
    memory, as a model's layers do. (A weight read twice running sits in the H200's L2 when it is
    as small as a Llama-8B o_proj; after Triton's L2 flush, the cache is full of lines to write
    back, and the two products came out within noise of each other, the choice changing from run
    to run.)"""
    size = weight.numel() * weight.element_size()
    count = min(8, -(-2 * torch.cuda.get_device_properties(weight.device).L2_cache_size // size))
    try:
        return [weight, *(weight.clone() for _ in range(count - 1))]
    except torch.cuda.OutOfMemoryError:  # no room beside the KV cache: timed on the one weight
        return [weight]


def _replay_us(product: Callable[[torch.Tensor], torch.Tensor], weights: list[torch.Tensor]) -> float:
    """Median microseconds of `product(w)` over `weights` in turn, replayed in a CUDA graph."""
    for w in weights:
        product(w)  # compiles and autotunes outside the capture
    ms = triton.testing.do_bench_cudagraph(lambda: [product(w) for w in weights], rep=20, return_mode="median")
    return ms * 1e3 / len(weights)
