"""Per-iteration statistics gathered in the API process from the engine's outputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagellm.core.outputs import SchedulerStats


@dataclass(slots=True)
class FinishedRequestStats:
    """One request that ended in this iteration."""

    finish_reason: str
    """stop | length | abort."""
    e2e_latency: float
    """Seconds from arrival to the final token."""
    queued_time: float
    """Seconds from arrival to first being scheduled."""
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass(slots=True)
class IterationStats:
    """What one batch of engine outputs added (counters are increments, not totals)."""

    num_prompt_tokens: int = 0
    """Prompt tokens of requests that produced their first token in this iteration."""
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives every iteration's stats in the API process."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats,
               engine_index: int = 0) -> None:
        """`scheduler_stats` of engine `engine_index` (a data-parallel replica), and what its latest
        outputs added."""
