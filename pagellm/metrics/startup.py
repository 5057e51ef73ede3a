"""Where start-up time goes: named phases with their durations, recorded where each happens (the
worker's weight loading, memory profile, KV cache, kernel warm-up and CUDA graph capture; the
engine; the API process), reported in one log line at ready, on `LLM(...).llm_engine.startup_phases`
and as the `pagellm:startup_seconds{phase=...}` gauge of the server's /metrics.

Phases of one report do not overlap: each process adds what the phases it knows of leave out of
its own wall time under a name of its own (`with_remainder`), so the phases add up to `total`.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator

LOAD_WEIGHTS = "load_weights"
PROFILE_RUN = "profile_run"
"""The largest step, run once to size the KV cache from the memory it peaks at (GPU only)."""
KV_CACHE_ALLOCATE = "kv_cache_allocate"
KERNEL_WARMUP = "kernel_warmup"
"""Triton compiling the kernels of the step shapes run outside CUDA graphs, and timing the one-row
products' tiles (`one_row_tiles`); both read from the cache folder where an earlier start stored them."""
CUDA_GRAPH_CAPTURE = "cuda_graph_capture"
START_WORKERS = "start_workers"
"""The executor's start besides its ranks' weight loading: rank processes (spawn, imports, process
groups), or the in-process worker."""
ENGINE_OTHER = "engine_other"
"""The rest of the engine's construction: scheduler, grammar compiler, plugins."""
ENGINE_CONFIG = "engine_config"
"""Reading the model's config and checking the engine arguments (`LLM(...)`)."""
ENGINE_PROCESS_START = "engine_process_start"
"""The engine-core process's own start (spawn, imports) and its ready message, from its spawn to the
moment it sent that message."""
API_SERVER = "api_server"
"""The API process's own work that the engine's start did not hide: its imports, flags and the
engine's configuration before the cores are spawned; then (the tokenizer, FastAPI and the app, built
while the cores start) only what outlasts them."""
FRONTEND = "frontend"
"""LLMEngine's own work around its engine core: tokenizer, input and output processors."""
TOTAL = "total"


class StartupPhases:
    """Durations in seconds by phase name, in the order first recorded; a phase recorded twice adds up."""

    def __init__(self, phases: dict[str, float] | None = None) -> None:
        self.seconds: dict[str, float] = dict(phases or {})

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as (part of) phase `name`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def as_dict(self) -> dict[str, float]:
        return dict(self.seconds)


def slowest(reports: Iterable[dict[str, float]]) -> dict[str, float]:
    """Each phase's longest duration over reports of work done side by side (ranks, replicas):
    the one the others waited for."""
    merged: dict[str, float] = {}
    for report in reports:
        for name, seconds in report.items():
            merged[name] = max(merged.get(name, 0.0), seconds)
    return merged


def with_remainder(phases: dict[str, float], wall_s: float, name: str) -> dict[str, float]:
    """`phases` plus phase `name`: what of `wall_s` they leave out (never negative)."""
    return {**phases, name: max(0.0, wall_s - sum(phases.values()))}


def with_total(phases: dict[str, float]) -> dict[str, float]:
    """`phases` and their sum as TOTAL."""
    return {**{k: v for k, v in phases.items() if k != TOTAL}, TOTAL: sum(v for k, v in phases.items() if k != TOTAL)}


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), interpreter and imports included; None
    where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def describe(phases: dict[str, float]) -> str:
    """One line for the log: 'total 12.3 s (load_weights 4.1 s, ...)'."""
    parts = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items() if name != TOTAL)
    total = phases.get(TOTAL, sum(phases.values()))
    return f"{total:.2f} s ({parts})"
