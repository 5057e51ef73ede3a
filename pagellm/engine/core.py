"""The step loop: schedule, execute, update. Runs in-process for LLM and in its own process for the server."""
from __future__ import annotations

import logging
from collections import deque

from pagellm.config import EngineConfig
from pagellm.config.kv_transfer import KV_CONNECTOR_REGISTRY, KVOffloadConfig
from pagellm.config.registry import resolve
from pagellm.core.kv_cache_groups import kv_cache_groups
from pagellm.core.kv_connector import KVConnectorScheduler
from pagellm.core.outputs import EngineCoreOutput, SchedulerStats
from pagellm.core.request import EngineCoreRequest, Request, RequestStatus
from pagellm.core.scheduler import Scheduler, SchedulerLimits
from pagellm.engine.gc_freeze import freeze_startup_objects
from pagellm.engine.heap import HeapTrimmer
from pagellm.executor import StepFuture, create_executor
from pagellm.lora.store import HostAdapterStore
from pagellm.plugins import load_plugins
from pagellm.spec_decode import build_host_proposer
from pagellm.structured_output.manager import GrammarManager

logger = logging.getLogger(__name__)

_GRAMMAR_WAIT_S = 0.05
"""Longest the idle step loop waits for a compile, so new input is still read promptly."""


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        load_plugins()  # the engine-core process's registries (its own process for the server)
        self.config = config
        self.executor = create_executor(config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            if num_blocks < 1:
                raise ValueError(_no_kv_block_error(config))
            kv_groups = kv_cache_groups(config.model.source.arch.sliding_windows, config.model.max_model_len)
            # Validates that max_model_len fits before the cache is allocated.
            limits = SchedulerLimits(
                max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                max_num_seqs=config.scheduler.max_num_seqs,
                max_model_len=config.model.max_model_len,
                block_size=config.cache.block_size,
                num_blocks=num_blocks,
                # A cached prefix's hidden states are never computed, and MEAN/CLS pooling needs
                # them (vLLM's pooling runner turns prefix caching off too).
                enable_prefix_caching=config.cache.enable_prefix_caching and not config.is_pooling,
                sliding_windows=tuple(g.sliding_window for g in kv_groups),
            )
            if len(kv_groups) > 1 or kv_groups[0].sliding_window is not None:
                logger.info("KV cache groups: %s; a decoding sequence of max_model_len (%d) tokens holds %d of the "
                            "%d blocks", ", ".join(g.describe() for g in kv_groups), limits.max_model_len,
                            limits.blocks_per_request(limits.max_model_len, 1), num_blocks)
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        pipelined = config.parallel.pipeline_parallel_size > 1
        # Later stages never see sampled ids on the device, so with several stages the scheduler
        # sends tokens and requests wait for theirs (no placeholders). Pooling requests sample
        # nothing: one waits for its pooled result and is never scheduled past its prompt.
        self.grammars = None if config.is_pooling else GrammarManager(
            config.model.source, config.model.source.arch.vocab_size, config.structured_outputs.compile_timeout_s,
            config.structured_outputs.reasoning_parser)
        self.adapters = None if config.lora is None else HostAdapterStore(
            config.model.source.arch, config.lora, self.executor.add_lora, self.executor.remove_lora)
        transfer = config.kv_transfer
        self.scheduler = Scheduler(limits, workers_see_samples=not pipelined and not config.is_pooling,
                                   grammars=self.grammars, speculative=config.speculative,
                                   proposer=build_host_proposer(config.speculative), adapters=self.adapters,
                                   policy=config.scheduler.policy,
                                   connector=None if transfer is None else build_kv_connector_scheduler(
                                       transfer, config.cache.block_size, self.executor.num_host_blocks()),
                                   swap_preemption=transfer is not None and transfer.preemption_mode == "swap")
        self.num_blocks = num_blocks
        # Overlap pays only where the device runs asynchronously to the host. The pooling runner
        # steps without it, which is simpler and keeps any placeholder token from ever being
        # scheduled for a pooling request (its last step yields a vector, not a token).
        self.overlap = config.scheduler.async_scheduling and not pipelined and not config.is_pooling
        self._in_flight: deque[StepFuture] = deque()
        self._heap = HeapTrimmer()
        # An engine holds no reference cycles, so dropping it still frees it.
        freeze_startup_objects()

    def add_request(self, record: EngineCoreRequest) -> None:
        self.scheduler.add_request(record)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    @property
    def _max_in_flight(self) -> int:
        """Steps launched and not yet collected while a step is being scheduled: one per pipeline
        stage (a batch queue, so that no stage idles), two with overlap (step N+1 is scheduled
        and launched while the device runs step N), else one."""
        if self.executor.max_concurrent_batches > 1:
            return self.executor.max_concurrent_batches
        return 2 if self.overlap and self.scheduler.can_overlap else 1

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step, then return the results of the oldest step in flight once
        as many steps are in flight as may be, or when there is nothing new to launch.

        With overlap, the host schedules and prepares step N+1 while the device runs step N, so a
        step's results come back from the next call; with pipeline stages, from the call that
        fills the pipeline. Otherwise each call runs one step to the end.
        """
        depth = self._max_in_flight
        outputs = []
        while len(self._in_flight) >= depth:  # e.g. overlap just ended: tokens must be known first
            outputs += self._collect()
        so = self.scheduler.schedule()
        launched = not (so.is_empty and not so.freed_req_ids and so.kv_connector_metadata is None)
        if launched:
            self._in_flight.append(self.executor.execute_model(so))
        if self._in_flight and (len(self._in_flight) >= depth or not launched):
            outputs += self._collect()
        # Nothing to compute: only requests whose grammar compiles, adapter loads or KV transfer
        # runs (a launched step polled the workers for it). Don't spin.
        if so.is_empty and not outputs:
            self.scheduler.wait_for_pending(_GRAMMAR_WAIT_S)
        self._heap.maybe_trim()
        return outputs

    def _collect(self) -> list[EngineCoreOutput]:
        """Wait for the oldest step in flight and apply its tokens."""
        return self.scheduler.update_from_output(self._in_flight.popleft().result())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def check_health(self) -> None:
        """Raise if the executor lost a rank."""
        self.executor.check_health()

    def take_rejected(self) -> list[tuple[str, str]]:
        """(request_id, why) of requests refused since the last call (a grammar that did not compile
        in time); they are gone from the scheduler."""
        rejected, self.scheduler.rejected = self.scheduler.rejected, []
        return rejected

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.adapters is not None:
            self.adapters.shutdown()
        self.executor.shutdown()


def build_kv_connector_scheduler(config: KVOffloadConfig, block_size: int,
                                 num_host_blocks: int) -> KVConnectorScheduler:
    """The scheduler half of the configured KV connector."""
    entry = KV_CONNECTOR_REGISTRY.get(config.transfer.kv_connector)
    cls = resolve(entry.scheduler_cls)
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorScheduler)):
        raise ValueError(f"KV connector {entry.name!r}: scheduler_cls must be a subclass of "
                         f"pagellm.core.kv_connector.KVConnectorScheduler, got {cls!r}")
    return cls(config, block_size, num_host_blocks)


def _no_kv_block_error(config: EngineConfig) -> str:
    """Why the KV cache got no block, naming the flags that size it."""
    cache = config.cache
    given = f" above {cache.kv_cache_memory_bytes}" if cache.kv_cache_memory_bytes is not None else ""
    gpu = (" or gpu_memory_utilization (--gpu-memory-utilization)"
           if config.device.type == "cuda" and cache.kv_cache_memory_bytes is None else "")
    return (f"the KV cache's memory holds no block of {cache.block_size} tokens (keys and values of every layer): "
            f"raise kv_cache_memory_bytes (--kv-cache-memory-bytes){given}{gpu}")
