"""Which tile the one-row kernel (`triton_matmul._gemv_kernel`) takes for a weight: at start-up, each
candidate timed on copies of the weight, replayed in a CUDA graph, and the fastest kept per weight
shape and layout.

A model's layers stream their weights from memory once a step. Triton's autotuner times one weight
over and over: a weight as small as a Llama-8B o_proj then sits in the H200's L2, or, after the
autotuner's cache flush, competes with the flush's write-backs. Several tiles time within a few
percent of each other there, and its choice changed from one engine start to the next; in the
engine the choices differed by up to a tenth of batch-1 decode speed
(`benchmarks/results/one_row_tiles_in_situ_*.json`).

Timing happens only within `timing_one_row_products()` (the model runner's warm-up steps, before
its CUDA graphs are captured, and benchmarks): nothing is timed in the middle of serving. A shape
first met elsewhere takes its first candidate, each list's best tile on every shape in the engine.
Each choice is stored in the cache folder (`pagellm.ops.choice_cache`, one file per GPU model,
Triton and pagellm version) when the block ends, and read instead of timed at later starts.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple, Protocol

import torch
import triton
import triton.testing
from triton.compiler.errors import CompileTimeAssertionFailure
from triton.runtime.errors import OutOfResources, PTXASError

from pagellm.config.cache_dirs import cache_root
from pagellm.ops.choice_cache import ChoiceCache, choice_cache_path
from pagellm.version import __version__

logger = logging.getLogger(__name__)

MAX_COPIES = 32
"""Copies a weight is timed over at most: twice the L2 cache of weights smaller than 1/16 of it
(a 135M model's) is more graph nodes than the timing needs, and such weights run from L2 anyway."""

_AsyncCompileMode = getattr(triton, "AsyncCompileMode", None)
"""Triton's compiles on threads of an executor, where this Triton has it; None: one after another."""
TILE_SECTION = "one_row_tile"
"""The stored choices' section of the tiles (`choice_cache`)."""


class OneRowKey(NamedTuple):
    """What a one-row tile is chosen for (`choose`)."""
    device: torch.device
    n: int
    k: int
    row_stride: int  # of the weight as the kernel reads it (int32 words for 4-bit codes)
    weight_dtype: torch.dtype
    x_dtype: torch.dtype
    scale_dtype: torch.dtype | None  # None: a dense weight
    layout: tuple  # the kernel's constants, (name, value) pairs


class OneRowProduct(Protocol):
    def __call__(self, config: triton.Config, w: torch.Tensor, compile_only: bool = False) -> object:
        """Launch the product with tile `config` on weight `w` (the layer's weight or a copy of
        it); with `compile_only`, compile that kernel variant without launching it."""


_CHOSEN: dict[OneRowKey, triton.Config] = {}
"""Per (device, weight shape, layout, dtypes): the tile timed fastest (or stored)."""
_STORES: dict[str, ChoiceCache] = {}
"""Per GPU model: the choices stored in the cache folder, read at the first product on it."""
_timing = False


@contextlib.contextmanager
def timing_one_row_products() -> Iterator[None]:
    """Within the block, a one-row product of a weight shape not yet timed is timed: its tile here,
    and whether a dense weight's beats cuBLAS (`dense_one_row`)."""
    global _timing
    _timing = True
    try:
        yield
    finally:
        _timing = False
        for store in _STORES.values():
            store.save()


def timing() -> bool:
    """Whether a product first met now may be timed (within `timing_one_row_products`, outside a
    CUDA graph capture)."""
    return _timing and not torch.cuda.is_current_stream_capturing()


def stored_choices(device: torch.device) -> ChoiceCache:
    """The choices stored for `device`'s GPU model with this Triton and pagellm."""
    name = _device_model(device)
    store = _STORES.get(name)
    if store is None:
        identity = {"device": name, "triton": triton.__version__, "pagellm": __version__}
        store = _STORES[name] = ChoiceCache.load(choice_cache_path(cache_root(), identity), identity)
    return store


@functools.cache
def _device_model(device: torch.device) -> str:
    """The GPU model's name (its choices' file), asked of the driver once per device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def choice_key(key: tuple) -> str:
    """A choice's key in the stored file: `key` (its device first) without the device, whose GPU
    model names the file."""
    return repr(tuple(key)[1:])


def config_json(config: triton.Config) -> dict[str, object]:
    """A tile as stored (`choice_cache`)."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages}


def choose(key: OneRowKey, configs: Sequence[triton.Config], run: OneRowProduct,
           weight: torch.Tensor) -> triton.Config:
    """The tile for `key` (which names the weight in the log): stored at an earlier start, or timed
    on its first use within `timing_one_row_products`, else the first of `configs`."""
    chosen = _CHOSEN.get(key)
    if chosen is not None:
        return chosen
    store = stored_choices(key.device)
    stored = store.get(TILE_SECTION, choice_key(key))
    # Only a tile still among the candidates: a stored one that is not is timed again.
    chosen = next((c for c in configs if stored is not None and config_json(c) == stored), None)
    if chosen is not None:
        _CHOSEN[key] = chosen
        return chosen
    if not timing():
        return configs[0]
    compile_side_by_side(configs, run, weight)
    weights = uncached_copies(weight)
    times: dict[triton.Config, float] = {}
    for config in configs:
        try:
            times[config] = replay_us(lambda w, c=config: run(c, w), weights)
        except (OutOfResources, PTXASError, CompileTimeAssertionFailure):  # the tile does not fit this GPU
            continue
    del weights
    if not times:
        raise RuntimeError(f"no one-row tile compiles for {key} on {torch.cuda.get_device_name(weight.device)}")
    chosen = _CHOSEN[key] = min(times, key=times.__getitem__)
    store.put(TILE_SECTION, choice_key(key), config_json(chosen))
    logger.info("one-row tile for %s: %s (%.1f us; slowest candidate %.1f us)", key, chosen, times[chosen],
                max(times.values()))
    logger.debug("one-row candidates for %s: %s", key, {str(c): round(t, 2) for c, t in times.items()})
    return chosen


def compile_side_by_side(configs: Sequence[triton.Config], run: OneRowProduct, weight: torch.Tensor) -> None:
    """Compile the candidates' kernel variants on threads at once, before they are timed one after
    another: on a machine with nothing cached, a shape's dozen candidates otherwise compile one by
    one, a second or more each. Where Triton cannot (too old), or a candidate fails to compile here,
    the timing compiles it (and skips one that does not fit the GPU), as without this."""
    if _AsyncCompileMode is None or len(configs) < 2:
        return
    with ThreadPoolExecutor(min(len(configs), os.cpu_count() or 1), thread_name_prefix="pagellm-compile") as pool:
        try:
            with _AsyncCompileMode(pool, ignore_errors=True):
                for config in configs:
                    try:
                        run(config, weight, compile_only=True)
                    except Exception as e:  # noqa: BLE001 - the timing compiles it again and reports what is wrong
                        logger.debug("one-row tile %s did not compile ahead of its timing: %s", config, e)
        except RuntimeError as e:  # a caller's AsyncCompileMode is active: compiles wait for the timing
            logger.debug("one-row tiles compile one by one: %s", e)


def uncached_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """The weight and as many copies as make twice the L2 cache (at most MAX_COPIES in all): read
    in turn, each comes from memory, as a model's layers do."""
    size = weight.numel() * weight.element_size()
    count = min(MAX_COPIES, -(-2 * torch.cuda.get_device_properties(weight.device).L2_cache_size // size))
    try:  # with the weight's own strides: the same product, the same tile key
        return [weight, *(torch.empty_strided(weight.shape, weight.stride(), dtype=weight.dtype,
                                              device=weight.device).copy_(weight) for _ in range(count - 1))]
    except torch.cuda.OutOfMemoryError:
        logger.warning("no room for copies of a weight %s: its one-row product is timed on the weight alone, "
                       "which may answer from the L2 cache", tuple(weight.shape))
        return [weight]


def replay_us(product: Callable[[torch.Tensor], object], weights: list[torch.Tensor]) -> float:
    """Median microseconds of `product(w)` over `weights` in turn, replayed in a CUDA graph."""
    for w in weights:
        product(w)  # compiles outside the capture
    ms = triton.testing.do_bench_cudagraph(lambda: [product(w) for w in weights], rep=20, return_mode="median")
    return ms * 1e3 / len(weights)
