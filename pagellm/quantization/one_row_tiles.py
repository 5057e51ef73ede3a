"""Which tile the one-row kernel (`triton_matmul._gemv_kernel`) takes for a weight: each candidate
timed on copies of the weight that together exceed the L2 cache, replayed in a CUDA graph, and the
fastest kept per weight shape and layout.

A model's layers stream their weights from memory once a step. Triton's autotuner times one weight
over and over: a weight as small as a Llama-8B o_proj then sits in the H200's L2, or, after the
autotuner's cache flush, competes with the flush's write-backs. Several tiles time within a few
percent of each other there, and its choice changed from one engine start to the next; in the
engine the choices differed by up to a tenth of batch-1 decode speed
(`benchmarks/results/one_row_tiles_in_situ_*.json`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch
import triton
import triton.testing

logger = logging.getLogger(__name__)

_CHOSEN: dict[Hashable, triton.Config] = {}
"""Per (device, weight shape, layout, dtypes): the tile timed fastest."""


def choose(key: Hashable, configs: list[triton.Config], run: Callable[[triton.Config, torch.Tensor], object],
           weight: torch.Tensor) -> triton.Config:
    """The tile for `key`: timed on first use, `run(config, w)` launching the product on weight `w`
    (the layer's weight or a copy of it). Nothing is timed while a CUDA graph is captured: a shape
    first met there takes the first candidate (the engine's warm-up steps run every shape before
    its capture)."""
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        return chosen
    if torch.cuda.is_current_stream_capturing():
        return configs[0]
    weights = uncached_copies(weight)
    times = {}
    for config in configs:
        try:
            times[config] = replay_us(lambda w, c=config: run(c, w), weights)
        except triton.runtime.errors.OutOfResources:  # the tile needs more registers or shared memory
            continue
    del weights
    chosen = _CHOSEN[key] = min(times, key=times.__getitem__)
    logger.info("one-row tile for a %s weight %s: %s (%.1f us; slowest candidate %.1f us)", weight.dtype,
                tuple(weight.shape), chosen, times[chosen], max(times.values()))
    return chosen


def uncached_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and as many copies as make twice the L2 cache: read in turn, each comes from
    memory, as a model's layers do."""
    size = weight.numel() * weight.element_size()
    count = min(8, -(-2 * torch.cuda.get_device_properties(weight.device).L2_cache_size // size))
    try:
        return [weight, *(weight.clone() for _ in range(count - 1))]
    except torch.cuda.OutOfMemoryError:  # no room beside the KV cache: timed on the one weight
        return [weight]


def replay_us(product: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Median microseconds of `product(w)` over `weights` in turn, replayed in a CUDA graph."""
    for w in weights:
        product(w)  # compiles outside the capture
    ms = triton.testing.do_bench_cudagraph(lambda: [product(w) for w in weights], rep=20, return_mode="median")
    return ms * 1e3 / len(weights)
