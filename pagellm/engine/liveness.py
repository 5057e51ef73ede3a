"""Is the engine core alive and making progress? Judged in the API process from the core's heartbeats.

Two failures, with different thresholds:
- silence: no heartbeat for `heartbeat_timeout_s` (about a second). The heartbeat thread runs
  beside the step loop, so silence means the whole process is frozen (SIGSTOP, swapped out, a
  hung interpreter), not merely busy.
- stall: heartbeats arrive but the loop's step count has not moved for `stall_timeout_s`. The
  loop counts idle waits too (at most 0.5 s each), so an idle core never stalls; one step that
  outlasts the threshold does (a hung kernel, a deadlock). CPU steps can be slow: the default
  threshold is generous.

Times are the API process's receipt times, and callers read every pending heartbeat before
asking, so an API process that was itself busy for a while does not mistake queued heartbeats
for silence. When the API process was itself held up for long (a machine short of CPU or memory
stalls every process), the core's silence over that time is no evidence, and the silence clock
starts afresh: only a core that stays silent while this process runs normally counts as frozen.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_STALL_TIMEOUT_S = 300.0
"""Longest a single engine step may run before the engine counts as stalled (CPU prefills are slow)."""
HEARTBEAT_TIMEOUT_S = 1.0
"""Longest silence from the core's heartbeat thread (it sends every 0.2 s) before the core counts as dead."""
MIN_STALL_TIMEOUT_S = 1.0
"""An idle core's loop moves every 0.5 s; a shorter stall threshold would call an idle core stalled."""


@dataclass
class LivenessMonitor:
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S
    """None: never judge a core stalled, only silent or exited."""
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S
    _num_steps: int = field(default=-1, init=False)
    _last_heartbeat: float = field(default=0.0, init=False)
    _last_progress: float = field(default=0.0, init=False)
    _last_check: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.stall_timeout_s is not None and self.stall_timeout_s < MIN_STALL_TIMEOUT_S:
            raise ValueError(f"the engine stall timeout must be at least {MIN_STALL_TIMEOUT_S:g} s "
                             f"(--engine-stall-timeout), got {self.stall_timeout_s:g}")

    def start(self, now: float) -> None:
        """The core just said it is ready: every clock starts now."""
        self._last_heartbeat = self._last_progress = self._last_check = now

    def on_heartbeat(self, num_steps: int, now: float) -> None:
        self._last_heartbeat = now
        if num_steps != self._num_steps:
            self._num_steps, self._last_progress = num_steps, now

    def failure(self, now: float) -> str | None:
        """Why the core counts as dead at `now`, or None while it is healthy; called often (every
        heartbeat interval), after reading every pending heartbeat."""
        if now - self._last_check > self.heartbeat_timeout_s / 2:  # this process was held up itself
            self._last_heartbeat = now
        self._last_check = now
        silent_s = now - self._last_heartbeat
        if silent_s > self.heartbeat_timeout_s:
            return f"engine core sent no heartbeat for {silent_s:.1f} s (frozen or unreachable)"
        stuck_s = now - self._last_progress
        if self.stall_timeout_s is not None and stuck_s > self.stall_timeout_s:
            return (f"engine core stalled: step {self._num_steps + 1} has run for {stuck_s:.1f} s, more than "
                    f"--engine-stall-timeout {self.stall_timeout_s:g} s")
        return None
