"""The periodic progress log line, and turning the engine's running totals into increments."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.core.outputs import SchedulerStats
from pagellm.metrics.stats import IterationStats


@dataclass(slots=True)
class CumulativeDelta:
    """Turns a running total (some `SchedulerStats` counters are totals) into increments."""

    last_total: int = 0

    def update(self, total: int) -> int:
        """Returns how much `total` grew since the previous call.

        A total that went down means its source started counting again (a new engine, a reset),
        so everything in the new total is new rather than a negative increment.
        """
        delta = total - self.last_total if total >= self.last_total else total
        self.last_total = total
        return delta


class LoggingStatLogger:
    """Logs one line of throughput and cache state at most once per `interval_s`.

    The interval is checked inside `record`, so nothing is logged while no outputs arrive and no
    thread or timer is needed; `clock` is injectable so tests can move time by hand.
    """

    def __init__(self, interval_s: float = 10.0,
                 logger: logging.Logger = logging.getLogger("pagellm.metrics"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._logger = logger
        self._clock = clock
        self._prefix_queries = CumulativeDelta()
        self._prefix_hits = CumulativeDelta()
        self._reset(clock())

    def _reset(self, now: float) -> None:
        self._last_log_time = now
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_prefix_queries = 0
        self._num_prefix_hits = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._num_prompt_tokens += iteration_stats.num_prompt_tokens
        self._num_generation_tokens += iteration_stats.num_generation_tokens
        # Trackers are updated on every call, not only when logging, so the interval's hit rate
        # covers exactly the queries made since the previous line.
        self._num_prefix_queries += self._prefix_queries.update(
            scheduler_stats.prefix_cache_queries)
        self._num_prefix_hits += self._prefix_hits.update(scheduler_stats.prefix_cache_hits)

        now = self._clock()
        elapsed = now - self._last_log_time
        if elapsed < self.interval_s:
            return
        hit_rate = (self._num_prefix_hits / self._num_prefix_queries
                    if self._num_prefix_queries else 0.0)
        self._logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed,
            scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
            scheduler_stats.kv_cache_usage * 100, hit_rate * 100)
        self._reset(now)
