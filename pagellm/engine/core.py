"""The step loop: schedule, execute, update. Runs in-process for LLM and in its own process for the server."""
from __future__ import annotations

import logging

from pagellm.config import EngineConfig
from pagellm.core.outputs import EngineCoreOutput, SchedulerStats
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler, SchedulerLimits
from pagellm.engine.heap import HeapTrimmer
from pagellm.executor.uniproc import UniProcExecutor
from pagellm.worker.model_runner import StepInFlight

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = UniProcExecutor(config)
        num_blocks = self.executor.determine_num_blocks()
        args = config.args
        # Validates that max_model_len fits before the cache is allocated.
        limits = SchedulerLimits(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=config.max_model_len,
            block_size=args.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.executor.initialize_kv_cache(num_blocks)
        self.scheduler = Scheduler(limits)
        self.num_blocks = num_blocks
        # Overlap pays only where the device runs asynchronously to the host.
        self.overlap = args.async_scheduling if args.async_scheduling is not None else config.device.type == "cuda"
        self._in_flight: StepInFlight | None = None
        self._heap = HeapTrimmer()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and launch a step, then return the results of the one before it.

        With overlap, the host schedules and prepares step N+1 while the GPU runs step N; the
        results of a step therefore come back from the next call (the last ones from a call that
        finds nothing more to schedule). Without it, each call runs one step to the end.
        """
        overlap = self.overlap and self.scheduler.can_overlap
        outputs = [] if overlap else self._collect()
        so = self.scheduler.schedule()
        launched = None
        if not (so.is_empty and not so.freed_req_ids):
            launched = self.executor.launch_step(so)
        outputs += self._collect()
        self._in_flight = launched
        if not overlap:
            outputs += self._collect()
        self._heap.maybe_trim()
        return outputs

    def _collect(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight, if any, and apply its tokens."""
        if self._in_flight is None:
            return []
        step, self._in_flight = self._in_flight, None
        return self.scheduler.update_from_output(step.result())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

