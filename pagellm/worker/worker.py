"""One worker per device: loads the model, sizes and allocates the KV cache, runs steps."""
from __future__ import annotations

import logging

import torch

from pagellm.config import EngineConfig
from pagellm.core.outputs import SchedulerOutput
from pagellm.worker.model_runner import ModelRunner, StepInFlight

logger = logging.getLogger(__name__)
_GiB = 1 << 30


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)
        self.runner = ModelRunner(config)

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory budget (or the explicit override)."""
        args = self.config.args
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override
        block_bytes = self.runner.kv_bytes_per_block()
        if args.kv_cache_memory_bytes is not None:
            budget = args.kv_cache_memory_bytes
        elif self.config.device.type == "cpu":
            budget = self.config.default_cpu_kv_cache_bytes()
        else:
            budget = self._gpu_kv_budget()
        num_blocks = budget // block_bytes
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, args.block_size,
                    num_blocks * block_bytes / _GiB)
        return num_blocks

    def _gpu_kv_budget(self) -> int:
        """gpu_memory_utilization x total memory, minus weights and activation peak (both in the
        profiled peak) and minus what is not PyTorch's (CUDA context, other processes)."""
        peak = self.runner.profile_peak_memory()
        free, total = torch.cuda.mem_get_info(self.config.device)
        not_torch = (total - free) - torch.cuda.memory_reserved(self.config.device)
        budget = int(total * self.config.args.gpu_memory_utilization) - peak - not_torch
        logger.info("GPU memory: total %.2f GiB, peak of a full step %.2f GiB, not PyTorch's %.2f GiB",
                    total / _GiB, peak / _GiB, not_torch / _GiB)
        if budget <= 0:
            raise ValueError(
                f"no GPU memory is left for the KV cache: gpu_memory_utilization "
                f"{self.config.args.gpu_memory_utilization} allows {total * self.config.args.gpu_memory_utilization / _GiB:.2f} GiB "
                f"but weights and activations peak at {peak / _GiB:.2f} GiB and {not_torch / _GiB:.2f} GiB is used "
                f"outside PyTorch; raise --gpu-memory-utilization or lower --max-num-batched-tokens")
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()

    def launch_step(self, so: SchedulerOutput) -> StepInFlight:
        return self.runner.launch_step(so)
