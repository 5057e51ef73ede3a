"""Phases of a long benchmark run: each one capped in time, its failure recorded, the rest still run.

A device lease is short and a run is expensive: one phase that crashes or hangs must not cost the
results of the others. Each phase gets min(its cap, what is left of the run's budget); the cap is
enforced with SIGALRM (so it needs the main thread), and the phase function also receives its
deadline so loops that can stop early (the request driver) return partial results instead.
"""
from __future__ import annotations

import contextlib
import gc
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_GRACE_S = 5.0
"""A phase's own deadline comes this long (at most a quarter of its cap) before its alarm, so it can
stop cleanly first."""
_TRACEBACK_LINES = 15


class PhaseTimeout(Exception):
    """Raised inside a phase when its cap is reached."""


@dataclass
class PhaseRunner:
    budget_s: float
    """Seconds for all phases together, from the runner's creation."""
    caps: dict[str, float]
    """Seconds per phase name; a phase not named here gets what is left of the budget."""
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    _end: float = field(init=False)

    def __post_init__(self) -> None:
        self._end = time.perf_counter() + self.budget_s

    def run(self, name: str, fn: Callable[[float], dict[str, Any] | None]) -> dict[str, Any] | None:
        """Run `fn(deadline)` under the phase's cap; record and return its result (None on failure).

        The record: status ok | failed | timed_out | skipped, seconds, and the result or the error.
        """
        now = time.perf_counter()
        cap = min(self.caps.get(name, float("inf")), self._end - now)
        if cap <= 0:
            self.records[name] = {"status": "skipped", "error": "no time left in the run's budget"}
            print(f"[{name}] skipped: no time left in the run's budget", flush=True)
            return None
        record: dict[str, Any] = {"cap_s": cap}
        result = None
        try:
            with _alarm(cap):
                result = fn(now + cap - min(_GRACE_S, cap / 4))
            record.update(status="ok", result=result)
        except PhaseTimeout:
            record.update(status="timed_out", error=f"stopped at its cap of {cap:.0f} s")
        except Exception as e:  # noqa: BLE001 - any failure is recorded; the next phase still runs
            lines = traceback.format_exc().rstrip().splitlines()
            record.update(status="failed", error=f"{type(e).__name__}: {e}", traceback=lines[-_TRACEBACK_LINES:])
        record["seconds"] = time.perf_counter() - now
        self.records[name] = record
        gc.collect()  # after the except block: no traceback pins the phase's objects any more
        print(f"[{name}] {record['status']} in {record['seconds']:.1f} s"
              + (f": {record['error']}" if "error" in record else ""), flush=True)
        return result

    def ok(self, name: str) -> bool:
        return self.records.get(name, {}).get("status") == "ok"


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise PhaseTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def best_seconds(fn: Callable[[], object], reps: int, deadline: float, device: torch.device) -> float:
    """The fastest of up to `reps` calls of `fn`, the device synchronized before and after each; no
    call starts after `deadline` (a `time.perf_counter()` value): inf when none ran."""
    best = float("inf")
    for _ in range(reps):
        if time.perf_counter() > deadline:
            break
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
