"""LLMEngine: add requests, step, read outputs. For callers that stream or drive their own loop."""
from __future__ import annotations

import itertools
import logging
import time

from pagellm.config import EngineConfig
from pagellm.core.outputs import SchedulerStats
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import InputProcessor, PromptType
from pagellm.lora.adapter import load_adapter
from pagellm.lora_request import LoRARequest
from pagellm.metrics import startup
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, config_s: float = 0.0) -> None:
        """`config_s`: seconds it took to build `config` (`from_engine_args`), its own start-up phase."""
        start = time.perf_counter()
        self.config = config
        self.tokenizer: Tokenizer | None = load_tokenizer(config.model.source)
        self.processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, pooling=config.is_pooling)
        self.engine_core = EngineCore(config)
        self._request_counter = itertools.count()
        self._checked_loras: set[LoRARequest] = set()
        phases = startup.with_remainder(self.engine_core.startup_phases, time.perf_counter() - start,
                                        startup.FRONTEND)
        self.startup_phases: dict[str, float] = startup.with_total(
            {startup.ENGINE_CONFIG: config_s, **phases} if config_s else phases)
        """Seconds of each start-up phase, and their total (`pagellm.metrics.startup`)."""
        logger.info("engine ready in %s", startup.describe(self.startup_phases))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        start = time.perf_counter()
        config = args.create_engine_config()
        return cls(config, config_s=time.perf_counter() - start)

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Queue a request (n > 1: its children); raises ValueError (naming the field) on invalid input.
        PoolingParams (None: the defaults, on a pooling engine) make an embedding request.
        `lora_request`: the adapter it runs with (None: the base model). `priority`: lower runs
        first (with scheduling_policy priority)."""
        if params is None:
            params = PoolingParams() if self.config.is_pooling else SamplingParams()
        record, text = self.processor.process(request_id, prompt, params, arrival_time, lora_request, priority)
        for core_record in self.output_processor.add_request(record, text):
            self.engine_core.add_request(core_record)

    def check_lora(self, lora_request: LoRARequest) -> None:
        """Read and check an adapter now (once per LoRARequest), so that a bad one is a ValueError
        for the caller instead of requests the engine core refuses when it loads the adapter."""
        if lora_request in self._checked_loras or self.config.lora is None:
            return  # (without enable_lora, add_request says so)
        load_adapter(lora_request, self.config.model.source.arch, self.config.lora)
        self._checked_loras.add(lora_request)

    def abort_request(self, request_id: str | list[str]) -> list[RequestOutput]:
        """Abort requests (a parent of n > 1 aborts all its children); returns their final outputs."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.engine_core.abort_requests(self.output_processor.core_request_ids(ids))
        return self.output_processor.abort(ids)

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        """Run one engine step; returns the outputs it produced, as each request's output_kind says."""
        processed = self.output_processor.process(self.engine_core.step())
        # A stop string ended these in the output processor; the core would keep generating.
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs + self._end_rejected()

    def _end_rejected(self) -> list[RequestOutput]:
        """Requests the core refused after they arrived (a grammar that did not compile in time)
        end as aborted, with the reason logged: the other requests of a batch keep their results."""
        ids = []
        for core_request_id, error in self.engine_core.take_rejected():
            logger.warning("request %s refused: %s", core_request_id, error)
            ids.append(self.output_processor.caller_request_id(core_request_id))
        if not ids:
            return []
        self.engine_core.abort_requests(self.output_processor.core_request_ids(ids))
        return self.output_processor.abort(ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        stats = self.engine_core.stats()
        return stats.num_running_reqs + stats.num_waiting_reqs

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.stats()

    def shutdown(self) -> None:
        """Stop the engine's worker processes, if any (also done at exit)."""
        self.engine_core.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights)")
        return self.tokenizer
