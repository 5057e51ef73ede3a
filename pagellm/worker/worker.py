"""One worker per rank: joins its replica's process group, loads its shard of the model, sizes
and allocates its KV cache, and runs steps. Every executor drives the same Worker."""
from __future__ import annotations

import dataclasses
import logging
from collections import deque

import torch

from pagellm.config import EngineConfig
from pagellm.config.cache_dirs import use_cache_for_triton
from pagellm.core.kv_connector import KVConnectorOutput
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed import init_distributed, parallel_state
from pagellm.lora.adapter import LoRAAdapter
from pagellm.plugins import load_plugins
from pagellm.worker.kv_connector import kv_connector_worker_class
from pagellm.worker.model_runner import ModelRunner, StepInFlight

logger = logging.getLogger(__name__)
_GiB = 1 << 30

COLLECTIVE_TIMEOUT_S = 600.0
"""How long a rank waits in a collective for its peers before it fails. Peers run the same step,
so a healthy wait is short; a pipeline stage may wait a whole long prefill of the stage before it
on the CPU. A dead peer is noticed much sooner, by the executor."""


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None,
                 gpu_index: int | None = None) -> None:
        """`rank` in the replica (stage-major, see `pagellm.distributed`); with more than one rank,
        `distributed_init_method` is where the ranks meet (`file://...` or `tcp://host:port`).
        On CUDA, rank r takes the r-th GPU from the configured one, unless `gpu_index` names its
        GPU (a Ray actor sees only its own, as index 0)."""
        load_plugins()  # this rank's process's registries (an mp process or Ray actor of its own)
        parallel = config.parallel
        if parallel.cpu_threads is not None:
            # Steps run on this thread, so the C kernels' OpenMP loops (torch's libgomp) take it too.
            torch.set_num_threads(parallel.cpu_threads)
            if rank == 0:
                logger.info("each rank computes with %d CPU thread(s) (set with --cpu-threads)", parallel.cpu_threads)
        if config.device.type == "cuda":
            # Before any kernel compiles: kernels compiled at an earlier start (or shipped) are reused.
            use_cache_for_triton()
            index = config.device.index + rank if gpu_index is None else gpu_index
            config = dataclasses.replace(config, device=torch.device("cuda", index))
            torch.cuda.set_device(config.device)
        if parallel.world_size > 1:
            backend = "nccl" if config.device.type == "cuda" else "gloo"
            init_distributed(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size, backend,
                             distributed_init_method, COLLECTIVE_TIMEOUT_S, parallel.enable_expert_parallel)
        self.config = config
        self.rank = rank
        self.runner = ModelRunner(config)
        self._in_flight: deque[tuple[StepInFlight, KVConnectorOutput | None]] = deque()
        """Launched steps, each with its KV connector report."""

    @property
    def is_driver(self) -> bool:
        return parallel_state().is_driver

    def load_model(self) -> None:
        self.runner.load_model()

    def determine_num_blocks(self) -> int:
        """KV blocks that fit this rank's memory budget (or the explicit override)."""
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        block_bytes = self.runner.kv_bytes_per_block()
        if cache.kv_cache_memory_bytes is not None:
            budget = cache.kv_cache_memory_bytes
        elif self.config.device.type == "cpu":
            # The CPU budget is for the whole replica: its ranks share one machine's memory (data-
            # parallel replicas get their share as kv_cache_memory_bytes).
            budget = self.config.default_cpu_kv_cache_bytes() // self.config.parallel.world_size
        else:
            budget = self._gpu_kv_budget()
        connector = kv_connector_worker_class(self.config)
        if connector is not None and self.config.device.type == "cuda":
            budget -= connector.device_bytes(block_bytes)
        num_blocks = budget // block_bytes
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, cache.block_size,
                    num_blocks * block_bytes / _GiB)
        return num_blocks

    def _gpu_kv_budget(self) -> int:
        """gpu_memory_utilization x total memory, minus weights and activation peak (both in the
        profiled peak) and minus what is not PyTorch's (CUDA context, other processes)."""
        peak = self.runner.profile_peak_memory()
        free, total = torch.cuda.mem_get_info(self.config.device)
        not_torch = (total - free) - torch.cuda.memory_reserved(self.config.device)
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak - not_torch
        logger.info("GPU memory: total %.2f GiB, peak of a full step %.2f GiB, not PyTorch's %.2f GiB",
                    total / _GiB, peak / _GiB, not_torch / _GiB)
        if budget <= 0:
            utilization = self.config.cache.gpu_memory_utilization
            raise ValueError(
                f"no GPU memory is left for the KV cache: gpu_memory_utilization "
                f"{utilization} allows {total * utilization / _GiB:.2f} GiB "
                f"but weights and activations peak at {peak / _GiB:.2f} GiB and {not_torch / _GiB:.2f} GiB is used "
                f"outside PyTorch; raise --gpu-memory-utilization or lower --max-num-batched-tokens")
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks)
        self.runner.capture_cuda_graphs()

    def num_host_blocks(self) -> int:
        """Blocks the KV connector keeps outside the device on this rank (0: none)."""
        connector = self.runner.kv_connector
        return 0 if connector is None else connector.num_host_blocks

    def startup_phases(self) -> dict[str, float]:
        """Seconds of each start-up phase on this rank so far (`pagellm.metrics.startup`)."""
        return self.runner.startup.as_dict()

    def add_lora(self, adapter: LoRAAdapter) -> None:
        self.runner.lora.add(adapter)

    def remove_lora(self, lora_id: int) -> None:
        self.runner.lora.remove(lora_id)

    def execute_model(self, so: SchedulerOutput) -> None:
        """Launch a step; its results are read by a later `collect`, steps in launch order."""
        step = self.runner.launch_step(so)
        self._in_flight.append((step, self.runner.take_connector_output()))

    def collect(self) -> ModelRunnerOutput | None:
        """Wait for the oldest step launched, record its tokens in this worker's own states, and
        return its results on the driver (None on the other ranks)."""
        step, connector_output = self._in_flight.popleft()
        output = step.result()
        if not self.is_driver:
            return None
        output.kv_connector_output = connector_output
        return output

    def shutdown(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
