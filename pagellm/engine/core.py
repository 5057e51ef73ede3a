"""The step loop: schedule, execute, update. Runs in-process for LLM and in its own process for the server."""
from __future__ import annotations

import logging

from pagellm.config import EngineConfig
from pagellm.core.outputs import EngineCoreOutput, SchedulerStats
from pagellm.core.request import Request, RequestStatus
from pagellm.core.scheduler import Scheduler, SchedulerLimits
from pagellm.executor.uniproc import UniProcExecutor

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

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        if so.is_empty and not so.freed_req_ids:
            return []
        output = self.executor.execute_model(so)
        return self.scheduler.update_from_output(output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

