"""A single worker in the engine's own process."""
from __future__ import annotations

from pagellm.config import EngineConfig
from pagellm.core.outputs import SchedulerOutput
from pagellm.worker.model_runner import StepInFlight
from pagellm.worker.worker import Worker


class UniProcExecutor:
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def launch_step(self, so: SchedulerOutput) -> StepInFlight:
        return self.worker.launch_step(so)
