"""One worker in the engine's own process."""
from __future__ import annotations

from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.outputs import SchedulerOutput
from pagellm.executor.base import Executor, StepFuture
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    worker: Worker
    """In this process, so profilers and benchmarks may reach its runner."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute_model(self, so: SchedulerOutput) -> StepFuture:
        self.worker.execute_model(so)
        return StepFuture(self.worker.collect)

    def shutdown(self) -> None:
        pass
