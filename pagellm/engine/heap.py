"""Hands the C heap's free pages back to the operating system every few seconds.

glibc raises its mmap threshold each time a large block is freed, so later large buffers (a step's
activations and sampling tensors, whose shapes change every step) come from the heap instead; the
heap fragments and the process's RSS creeps up although nothing leaks. On SmolLM2 on the CPU,
50 rounds of `LLM.generate` over 6 requests each (mixing logprobs, n=2, stop strings, prompt
logprobs) grew the engine's RSS from 1,120 to 1,134-1,138 MiB with nothing retained by
Python (tracemalloc); trimming every TRIM_INTERVAL_S held it at 1,053-1,070 MiB, and the loop took
as long (143-147 s against 147-151 s). A trim takes about 5 ms there. Fixing the mmap threshold
instead (MALLOC_MMAP_THRESHOLD_) also stops the growth but made the same run 22% slower: every
large buffer then costs an mmap and fresh page faults.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable

TRIM_INTERVAL_S = 2.0


def _find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """Call `maybe_trim()` often (each engine step); it trims at most once per `interval_s`."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S, clock: Callable[[], float] = time.monotonic,
                 trim: Callable[[int], int] | None = None) -> None:
        self._trim = trim if trim is not None else _find_malloc_trim()
        self._interval_s = interval_s
        self._clock = clock
        self._last = clock()

    @property
    def available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed since the last trim; whether it did."""
        if self._trim is None:
            return False
        now = self._clock()
        if now - self._last < self._interval_s:
            return False
        self._trim(0)
        self._last = now
        return True
