"""One worker in the engine's own process."""
from __future__ import annotations

import gc
from typing import Any

import torch

from pagellm.config import EngineConfig
from pagellm.core.outputs import SchedulerOutput
from pagellm.executor.base import Executor, StepFuture
from pagellm.worker.worker import Worker


class UniProcExecutor(Executor):
    worker: Worker | None
    """In this process, so profilers and benchmarks may reach its runner; None once shut down."""

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
        """Drop the worker, so that its weights and KV cache go back to the device (once no caller
        holds them); the executor cannot step afterwards."""
        if self.worker is not None:
            device = self.worker.config.device
            self.worker = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
