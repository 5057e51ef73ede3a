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


@dataclass(slots=True)
class _Interval:
    """What one engine did since its previous log line."""

    start: float
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_queries: int = 0
    num_prefix_hits: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_host_hits: int = 0


class LoggingStatLogger:
    """Logs one line of throughput and cache state per engine at most once per `interval_s`.

    The interval is checked inside `record`, so nothing is logged while no outputs arrive and no
    thread or timer is needed; `clock` is injectable so tests can move time by hand. With several
    engines (data parallel), each line names its engine.
    """

    def __init__(self, interval_s: float = 10.0,
                 logger: logging.Logger = logging.getLogger("pagellm.metrics"),
                 clock: Callable[[], float] = time.monotonic, num_engines: int = 1) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._logger = logger
        self._clock = clock
        self._prefix = "Engine %d: " if num_engines > 1 else ""
        start = clock()
        self._intervals = [_Interval(start) for _ in range(num_engines)]
        self._prefix_queries = [CumulativeDelta() for _ in range(num_engines)]
        self._prefix_hits = [CumulativeDelta() for _ in range(num_engines)]
        self._spec_drafted = [CumulativeDelta() for _ in range(num_engines)]
        self._spec_accepted = [CumulativeDelta() for _ in range(num_engines)]
        self._host_hits = [CumulativeDelta() for _ in range(num_engines)]

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats, engine_index: int = 0) -> None:
        interval = self._intervals[engine_index]
        interval.num_prompt_tokens += iteration_stats.num_prompt_tokens
        interval.num_generation_tokens += iteration_stats.num_generation_tokens
        # Trackers are updated on every call, not only when logging, so the interval's hit rate
        # covers exactly the queries made since the previous line.
        interval.num_prefix_queries += self._prefix_queries[engine_index].update(scheduler_stats.prefix_cache_queries)
        interval.num_prefix_hits += self._prefix_hits[engine_index].update(scheduler_stats.prefix_cache_hits)
        host = scheduler_stats.kv_transfer
        if host is not None:
            interval.num_host_hits += self._host_hits[engine_index].update(host.host_hit_tokens)
        spec = scheduler_stats.spec
        if spec is not None:
            interval.num_draft_tokens += self._spec_drafted[engine_index].update(spec.num_draft_tokens)
            interval.num_accepted_tokens += self._spec_accepted[engine_index].update(spec.num_accepted_tokens)

        now = self._clock()
        elapsed = now - interval.start
        if elapsed < self.interval_s:
            return
        hit_rate = (interval.num_prefix_hits / interval.num_prefix_queries
                    if interval.num_prefix_queries else 0.0)
        prefix_args = (engine_index,) if self._prefix else ()
        # The host tier's share of the prompt tokens looked up, beside the device's.
        host_part, host_args = ("", ()) if host is None else (", Host KV hit rate: %.1f%%", (
            100 * interval.num_host_hits / interval.num_prefix_queries if interval.num_prefix_queries else 0.0,))
        self._logger.info(
            self._prefix + "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%" + host_part, *prefix_args,
            interval.num_prompt_tokens / elapsed, interval.num_generation_tokens / elapsed,
            scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
            scheduler_stats.kv_cache_usage * 100, hit_rate * 100, *host_args)
        if spec is not None:
            self._logger.info(
                self._prefix + "Speculative decoding: %d draft tokens, %d accepted, acceptance rate %.1f%%",
                *prefix_args, interval.num_draft_tokens, interval.num_accepted_tokens,
                100 * interval.num_accepted_tokens / interval.num_draft_tokens if interval.num_draft_tokens else 0.0)
        self._intervals[engine_index] = _Interval(now)
