"""The executor boundary: the engine hands over scheduler outputs and gets back futures of plain
data. Workers keep their own state; nothing outside a worker touches its runner."""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput


class WorkerFailedError(RuntimeError):
    """A rank died, or raised, while the engine needed it; the replica cannot go on."""


class StepFuture:
    """The results of one launched step, read once and in launch order."""

    __slots__ = ("_resolve", "_output")

    def __init__(self, resolve: Callable[[], ModelRunnerOutput]) -> None:
        self._resolve = resolve
        self._output: ModelRunnerOutput | None = None

    def result(self) -> ModelRunnerOutput:
        if self._output is None:
            self._output = self._resolve()
        return self._output


class Executor(ABC):
    """Runs one replica's ranks. Subclasses differ only in where the workers live."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call `Worker.<method>(*args)` on every rank and return the results in rank order."""

    @abstractmethod
    def execute_model(self, so: SchedulerOutput) -> StepFuture:
        """Launch one step on every rank without waiting for it."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every rank; safe to call more than once."""

    def check_health(self) -> None:
        """Raise WorkerFailedError if a rank is gone (the engine calls this while idle, when no
        step would notice)."""

    @property
    def max_concurrent_batches(self) -> int:
        """Steps that can usefully be in flight at once: one per pipeline stage."""
        return self.config.parallel.pipeline_parallel_size

    def determine_num_blocks(self) -> int:
        """The smallest rank's KV capacity: every rank holds the same blocks."""
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))


_BACKENDS = {
    "uni": ("pagellm.executor.uniproc", "UniProcExecutor"),
    "mp": ("pagellm.executor.multiproc", "MultiprocExecutor"),
    "ray": ("pagellm.executor.ray_executor", "RayExecutor"),
}


def create_executor(config: EngineConfig) -> Executor:
    """Start the executor of `config.parallel.executor_backend`, its workers loaded and ready."""
    module, cls = _BACKENDS[config.parallel.executor_backend]
    return getattr(importlib.import_module(module), cls)(config)
