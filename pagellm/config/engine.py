"""The engine's resolved configuration: typed sub-configs, each read by the layer that needs it.

`EngineArgs` (`pagellm.engine.arg_utils`) holds what a user passed (`LLM(...)` keywords, CLI
flags); `EngineArgs.create_engine_config()` checks it against the model and the machine and
returns an `EngineConfig`. Nothing below the entrypoints reads the raw arguments.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from pagellm.config.grammar_limits import GrammarLimits
from pagellm.config.kv_transfer import KVOffloadConfig
from pagellm.config.lora import LoRAConfig
from pagellm.config.model import DraftModelConfig, ModelConfig
from pagellm.config.speculative import SpeculativeConfig

_GiB = 1 << 30


@dataclass(slots=True, frozen=True)
class CacheConfig:
    """The paged KV cache: block size, entry type, prefix caching and how much memory it gets."""

    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_dtype: torch.dtype = torch.float32
    """How entries are stored: the model's dtype, or float8_e4m3fn (--kv-cache-dtype fp8)."""
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use in all (weights, activations, KV cache)."""
    kv_cache_memory_bytes: int | None = None
    """The cache's size in bytes per rank; None: from gpu_memory_utilization (GPU) or
    `EngineConfig.default_cpu_kv_cache_bytes` (CPU)."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (tests, debugging)."""


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """What one step may hold, and whether the next step is prepared while one runs."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    async_scheduling: bool = False
    """Schedule step N+1 while the device runs step N (where the engine allows it)."""
    policy: str = "fcfs"
    """fcfs | priority: the order requests are admitted and preempted in (`pagellm.core.request_queue`)."""


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    """How one model replica is split over ranks (see `pagellm.distributed`)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    """Replicas, each of `world_size` ranks (the server runs one engine core per replica)."""
    executor_backend: str = "uni"
    cpu_threads: int | None = None
    """Threads each rank computes with on the host (PyTorch's and the C kernels' OpenMP threads);
    None: PyTorch's default. `pagellm.config.cpu_threads` picks it."""
    step_timeout_s: float | None = None
    """Longest wait for a step's results from ranks in other processes (mp, ray), plus
    `step_timeout_per_token_s` per scheduled token, before they count as hung; None: no limit."""
    step_timeout_per_token_s: float = 0.0
    enable_expert_parallel: bool = False
    """Mixture-of-experts layers split their experts over the tensor-parallel ranks (whole experts
    per rank) instead of slicing every expert (`pagellm.layers.moe`)."""

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(slots=True, frozen=True)
class StructuredOutputsConfig:
    """Grammars of structured output, and the reasoning parser their enforcement waits for."""

    compile_timeout_s: float = 10.0
    """Seconds a request's grammar may take to compile before the request is refused."""
    max_bytes: int = 65536
    """Largest schema, regex, grammar or choice list a request may send (bytes of its JSON text)."""
    limits: GrammarLimits = field(default_factory=GrammarLimits)
    """How complex a spec may be (depth, enum values, regex expansion, ...)."""
    reasoning_parser: str | None = None
    """How the model marks its reasoning (`pagellm.reasoning`); None: it does not."""


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Everything the engine, its executor and its workers run with, resolved and checked."""

    model: ModelConfig
    device: torch.device
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None
    """Speculative decoding (None: off)."""
    draft: DraftModelConfig | None = None
    """The draft model of draft_model speculation."""
    lora: LoRAConfig | None = None
    """LoRA adapters (None: off, `--enable-lora`)."""
    kv_transfer: KVOffloadConfig | None = None
    """The KV connector (a host tier, `--kv-offloading-size`, `--kv-transfer-config`; None: none)."""

    @property
    def is_pooling(self) -> bool:
        return self.model.is_pooling

    @staticmethod
    def default_cpu_kv_cache_bytes() -> int:
        """The CPU's KV-cache budget when none is given: min(4 GiB, a quarter of RAM)."""
        total_ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return min(4 * _GiB, total_ram // 4)
