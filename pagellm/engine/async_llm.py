"""AsyncLLM: the API-process side of the engine, for the server.

Tokenization, validation, detokenization and statistics happen here, in the asyncio process; the
step loop runs in separate engine-core processes (`core_proc.py`), one per data-parallel replica,
reached over ZMQ sockets (`core_client.py`): requests in, outputs back, and heartbeats from a
thread of each core, from which `liveness.py` judges whether a core is dead, frozen or stalled.
Requests are routed to replicas by prefix and load (`dp_router.py`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator

import torch
import zmq
import zmq.asyncio

from pagellm.config import EngineConfig
from pagellm.core.kv_connector import KVTransferStats
from pagellm.core.outputs import LoRAStats, SchedulerStats, SpecDecodeStats, merge_step_outputs
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core_client import CoreClient
from pagellm.engine.core_proc import HEARTBEAT_INTERVAL_S
from pagellm.engine.dp_router import DataParallelRouter
from pagellm.engine.liveness import DEFAULT_STALL_TIMEOUT_S
from pagellm.engine.mailbox import OutputMailbox
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import InputProcessor, PromptType
from pagellm.engine.wire import AbortRequests, CoreOutputs, EngineFailed, encoder, heartbeat_decoder, output_decoder
from pagellm.lora_request import LoRARequest
from pagellm.metrics.startup import ENGINE_PROCESS_START, slowest, with_remainder
from pagellm.metrics.stats import IterationStats, StatLogger
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import RequestOutputKind, SamplingParams
from pagellm.structured_output import GrammarError
from pagellm.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

_MAX_STEPS_PER_READ = 64
"""Most engine steps the output loop reads and merges at once: its outputs still go out promptly."""


class EngineDeadError(RuntimeError):
    """An engine-core process exited, froze or stalled."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None,
                 stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S, *, wait: bool = True) -> None:
        """`stall_timeout_s`: how long one engine step may run before the engine counts as dead
        (None: never; a core that stops heartbeating or exits is dead regardless). `wait`: return
        once the cores are ready; False returns once their processes are spawned, so that the caller
        does its own start-up work while they load the model, then calls `wait_until_ready` (and
        `shutdown` should that work fail)."""
        self.config = config
        self.stat_loggers = list(stat_loggers or [])
        self._mailboxes: dict[str, OutputMailbox] = {}
        self._core_of: dict[str, CoreClient] = {}
        """Caller request id -> the replica serving it."""
        self._dead_reason: str | None = None
        """Why the engine stopped taking requests: the first core found dead."""
        self._output_task: asyncio.Task | None = None
        self._dead: asyncio.Future | None = None
        """Done once a core is found dead (`wait_until_dead`)."""
        self._ctx = zmq.asyncio.Context()
        self._cores: list[CoreClient] = []
        num_replicas = self.config.parallel.data_parallel_size
        self.router = DataParallelRouter(num_replicas, self.config.cache.block_size)
        self._spawned_at = time.perf_counter()
        try:
            # The cores first: they import and load the model while this process reads the tokenizer.
            for index in range(num_replicas):
                self._cores.append(CoreClient(_replica_config(self.config, index), index, self._ctx,
                                              stall_timeout_s))
            self.tokenizer: Tokenizer | None = load_tokenizer(self.config.model.source)
            self.processor = InputProcessor(self.config, self.tokenizer)
            self.output_processor = OutputProcessor(self.tokenizer, pooling=self.config.is_pooling)
            if wait:
                self.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise

    def wait_until_ready(self) -> None:
        """Block until every core has loaded the model and sized its cache (the constructor does,
        unless given wait=False); raises with a core's reason if it fails to start."""
        for core in self._cores:
            core.wait_until_ready()
        # Replicas start side by side: the slowest one's phases, and what its process took besides,
        # until the last one was ready (this process may have read that later, busy with its own start).
        ready_at = max(core.ready_at for core in self._cores)
        self.startup_phases: dict[str, float] = with_remainder(
            slowest(core.startup_phases for core in self._cores), ready_at - self._spawned_at, ENGINE_PROCESS_START)
        """Seconds of each phase of the engine cores' start, as this process waited for them
        (`pagellm.metrics.startup`)."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                         stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S) -> "AsyncLLM":
        return cls(args.create_engine_config(), stat_loggers, stall_timeout_s)

    @property
    def engine_pids(self) -> list[int]:
        """The engine-core processes' pids, one per replica (for supervisors, and tests that kill
        or freeze one)."""
        return [core.process.pid for core in self._cores]

    @property
    def num_blocks(self) -> int:
        """KV blocks of each replica (the smallest, should they differ)."""
        return min(core.num_blocks for core in self._cores)

    # -- requests -------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | PoolingParams,
                       request_id: str, lora_request: LoRARequest | None = None, *, priority: int = 0,
                       ) -> AsyncIterator[RequestOutput | EmbeddingRequestOutput]:
        """Outputs of one request, as its output_kind says (n > 1: all sequences in one output);
        stopping the iteration aborts it in the engine. `lora_request`: the adapter it runs with.
        `priority`: lower runs first (with scheduling_policy priority)."""
        self._raise_if_dead()
        self._ensure_output_task()
        if request_id in self._mailboxes:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(sampling_params, SamplingParams) and sampling_params.structured_outputs is not None:
            await asyncio.to_thread(self.processor.check_structured_outputs, sampling_params)
        record, text = self.processor.process(request_id, prompt, sampling_params, lora_request=lora_request,
                                              priority=priority)
        core_records = self.output_processor.add_request(record, text)
        cost = sum(len(r.prompt_token_ids) + r.max_tokens for r in core_records)
        core = self._cores[self.router.route(record.prompt_token_ids, cost, [c.load for c in self._cores],
                                             [c.failure_reason is None for c in self._cores])]
        mailbox = OutputMailbox(coalesce=isinstance(sampling_params, SamplingParams)
                                and sampling_params.output_kind == RequestOutputKind.DELTA)
        self._mailboxes[request_id] = mailbox
        self._core_of[request_id] = core
        core.load += cost
        finished = False
        try:
            # Inside the try: a cancellation between the sends still withdraws the ones sent.
            for core_record in core_records:
                await core.input.send(encoder.encode(core_record))
            while not finished:
                item = await mailbox.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            core.load -= cost
            self._mailboxes.pop(request_id, None)
            if not finished:  # the consumer went away (client disconnect, cancellation)
                self._abort_now([request_id])
            self._core_of.pop(request_id, None)

    def encode(self, prompt: PromptType, pooling_params: PoolingParams, request_id: str,
               lora_request: LoRARequest | None = None) -> AsyncIterator[EmbeddingRequestOutput]:
        """One embedding request (pooling runner): a single output, its vector, when its prompt has
        run through the model; as `generate` otherwise (closing the iterator early aborts it)."""
        return self.generate(prompt, pooling_params, request_id, lora_request)

    async def abort(self, request_id: str) -> None:
        mailbox = self._mailboxes.pop(request_id, None)
        outputs = self._abort_now([request_id])
        if mailbox is not None:
            for out in outputs:
                mailbox.put(out)

    def _abort_now(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            core = self._core_of.get(request_id)
            core_ids = self.output_processor.core_request_ids([request_id])
            stats = IterationStats()
            aborted = self.output_processor.abort([request_id], stats)
            if aborted and core is not None:
                self._send_abort(core, core_ids)
                self._log_stats(stats, core.index)
            outputs += aborted
        return outputs

    def _send_abort(self, core: CoreClient, core_request_ids: list[str]) -> None:
        if core.failure_reason is not None:
            return
        # A plain (non-awaited) send: this also runs from generators' `finally` during cancellation.
        core.input.send(encoder.encode(AbortRequests(core_request_ids)), flags=zmq.NOBLOCK)

    # -- the output loop --------------------------------------------------------------------------

    def _ensure_output_task(self) -> None:
        # Restarted when done: each asyncio.run() (tests, scripts) ends the previous loop's task.
        if self._dead_reason is None and (self._output_task is None or self._output_task.done()):
            loop = asyncio.get_running_loop()
            self._dead = loop.create_future()
            self._output_task = loop.create_task(self._output_loop())

    async def _output_loop(self) -> None:
        """Hand outputs to their requests and watch the cores' liveness. A core found dead fails
        its own requests and marks the engine dead (no new requests); the others' requests go on."""
        poller = zmq.asyncio.Poller()
        for core in self._cores:
            poller.register(core.output, zmq.POLLIN)
            poller.register(core.heartbeats, zmq.POLLIN)
        try:
            while True:
                await poller.poll(int(HEARTBEAT_INTERVAL_S * 1000))
                live = [core for core in self._cores if core.failure_reason is None]
                for core in live:
                    # Every step waiting is read first and handled as one: behind the engine, this
                    # process then does its per-request work once for all of them.
                    messages, failed = [], None
                    while len(messages) < _MAX_STEPS_PER_READ and failed is None and await core.output.poll(0):
                        message = output_decoder.decode(await core.output.recv())
                        if isinstance(message, CoreOutputs):
                            messages.append(message)
                        elif isinstance(message, EngineFailed):
                            failed = message
                    if messages:
                        self._handle(core, CoreOutputs(
                            merge_step_outputs([m.outputs for m in messages]), messages[-1].stats,
                            [r for m in messages for r in m.rejected]))
                    if failed is not None:
                        self._fail_core(core, f"engine core failed: {failed.error}")
                # Every pending heartbeat is read before judging: after this process was busy for a
                # while, queued heartbeats are not silence.
                now = time.monotonic()
                for core in live:
                    while await core.heartbeats.poll(0):
                        beat = heartbeat_decoder.decode(await core.heartbeats.recv())
                        core.liveness.on_heartbeat(beat.num_steps, now)
                for core in live:
                    reason = core.failure(now) if core.failure_reason is None else None
                    if reason is not None:
                        self._fail_core(core, reason)
        except Exception as e:  # a bug here must fail requests, not leave them waiting forever
            logger.exception("engine output loop failed")
            for core in self._cores:
                if core.failure_reason is None:
                    self._fail_core(core, f"engine output loop failed: {type(e).__name__}: {e}")

    def _handle(self, core: CoreClient, message: CoreOutputs) -> None:
        core.stats = message.stats
        for core_request_id, error in message.rejected:
            # A rejected child fails its whole parent: its siblings are withdrawn too.
            request_id = self.output_processor.caller_request_id(core_request_id)
            siblings = [i for i in self.output_processor.core_request_ids([request_id]) if i != core_request_id]
            self.output_processor.abort([request_id])
            if siblings:
                self._send_abort(core, siblings)
            mailbox = self._mailboxes.get(request_id)
            if mailbox is not None:
                mailbox.put(GrammarError.from_message(error) if GrammarError.describes(error) else ValueError(error))
        stats = IterationStats()
        processed = self.output_processor.process(message.outputs, stats)
        if processed.reqs_to_abort:
            self._send_abort(core, processed.reqs_to_abort)  # ended by a stop string; the core would go on
        for out in processed.request_outputs:
            mailbox = self._mailboxes.get(out.request_id)
            if mailbox is not None:
                mailbox.put(out)
        self._log_stats(stats, core.index)

    def _log_stats(self, stats: IterationStats, engine_index: int) -> None:
        scheduler_stats = self._cores[engine_index].stats
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler_stats, stats, engine_index)

    def _fail_core(self, core: CoreClient, reason: str) -> None:
        """Fail the requests of a replica that died; the other replicas' requests go on."""
        core.failure_reason = reason
        if self._dead_reason is None:
            self._dead_reason = reason if len(self._cores) == 1 else f"engine core {core.index}: {reason}"
            if self._dead is not None and not self._dead.done():
                self._dead.set_result(None)
        failed = [request_id for request_id, owner in self._core_of.items() if owner is core]
        logger.error("engine core %d: %s; failing its %d in-flight requests", core.index, reason, len(failed))
        for request_id in failed:
            mailbox = self._mailboxes.get(request_id)
            if mailbox is not None:
                mailbox.put(EngineDeadError(reason))

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    async def wait_until_dead(self) -> str:
        """Watch the cores from now on (not only once a request comes) and return why one died."""
        self._ensure_output_task()
        if self._dead_reason is None:
            await asyncio.shield(self._dead)
        return self._dead_reason

    # -- state and shutdown -------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        """The replicas' latest scheduler stats, summed (KV usage: their mean)."""
        total = SchedulerStats()
        for field in dataclasses.fields(SchedulerStats):
            if field.name not in ("spec", "lora", "num_waiting_by_priority", "kv_transfer"):
                setattr(total, field.name, sum(getattr(core.stats, field.name) for core in self._cores))
        total.kv_cache_usage /= len(self._cores)
        total.num_waiting_by_priority = dict(sum((Counter(core.stats.num_waiting_by_priority) for core in self._cores),
                                                 Counter()))
        total.spec = SpecDecodeStats.total([core.stats.spec for core in self._cores if core.stats.spec is not None])
        total.lora = LoRAStats.total([core.stats.lora for core in self._cores if core.stats.lora is not None])
        total.kv_transfer = KVTransferStats.total([core.stats.kv_transfer for core in self._cores
                                                   if core.stats.kv_transfer is not None])
        return total

    @property
    def is_running(self) -> bool:
        return self._dead_reason is None and all(core.process.is_alive() for core in self._cores)

    def shutdown(self) -> None:
        """Stop the cores and close the sockets; a second call does nothing."""
        if self._ctx.closed:
            return
        for core in self._cores:
            core.shutdown(graceful=self._dead_reason is None)
        if self._output_task is not None:
            self._output_task.cancel()
        self._ctx.term()


def _replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s configuration: one replica of its own (the API process checked that all of
    them fit), on CUDA the next `world_size` GPUs after the previous replica's, on the CPU its share
    of the default KV-cache memory."""
    parallel = config.parallel
    replica = dataclasses.replace(config, parallel=dataclasses.replace(parallel, data_parallel_size=1))
    if config.device.type == "cuda":
        return dataclasses.replace(
            replica, device=torch.device("cuda", config.device.index + index * parallel.world_size))
    if config.cache.kv_cache_memory_bytes is None:
        num_ranks = parallel.world_size * parallel.data_parallel_size
        cache = dataclasses.replace(config.cache,
                                    kv_cache_memory_bytes=config.default_cpu_kv_cache_bytes() // num_ranks)
        return dataclasses.replace(replica, cache=cache)
    return replica
