"""AsyncLLM: the API-process side of the engine, for the server.

Tokenization, validation, detokenization and statistics happen here, in the asyncio process; the
step loop runs in a separate engine-core process (`core_proc.py`), reached over ZMQ sockets: requests
in, outputs back, and heartbeats from a thread of the core, from which `liveness.py` judges whether
the core is dead, frozen or stalled.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from pagellm.config import EngineArgs, EngineConfig
from pagellm.core.outputs import SchedulerStats
from pagellm.engine.core_proc import HEARTBEAT_INTERVAL_S, run_engine_core
from pagellm.engine.liveness import DEFAULT_STALL_TIMEOUT_S, LivenessMonitor
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.processor import InputProcessor, PromptType
from pagellm.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreOutputs,
    Ready,
    Shutdown,
    StartupFailed,
    encoder,
    heartbeat_decoder,
    output_decoder,
)
from pagellm.metrics.stats import IterationStats, StatLogger
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Longest wait for the core to load the model and size its cache."""


class EngineDeadError(RuntimeError):
    """The engine-core process exited, froze or stalled."""


class AsyncLLM:
    def __init__(self, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                 stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S) -> None:
        """`stall_timeout_s`: how long one engine step may run before the engine counts as dead
        (None: never; a core that stops heartbeating or exits is dead regardless)."""
        self.config: EngineConfig = args.create_engine_config()
        self._liveness = LivenessMonitor(stall_timeout_s)
        self.tokenizer: Tokenizer | None = load_tokenizer(self.config.source)
        self.processor = InputProcessor(self.config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_loggers = list(stat_loggers or [])
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats = SchedulerStats()
        self._dead_reason: str | None = None
        self._output_task: asyncio.Task | None = None

        self._ipc_dir = tempfile.TemporaryDirectory(prefix="pagellm-")
        input_address = f"ipc://{os.path.join(self._ipc_dir.name, 'input')}"
        output_address = f"ipc://{os.path.join(self._ipc_dir.name, 'output')}"
        heartbeat_address = f"ipc://{os.path.join(self._ipc_dir.name, 'heartbeat')}"
        self._ctx = zmq.asyncio.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.bind(input_address)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.bind(output_address)
        self._heartbeats = self._ctx.socket(zmq.PULL)
        self._heartbeats.bind(heartbeat_address)
        # spawn, not fork: the child must not inherit this process's threads or CUDA state.
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(args, input_address, output_address, heartbeat_address),
            name="pagellm-engine-core", daemon=True)
        self._process.start()
        self.num_blocks = self._wait_until_ready()
        self._liveness.start(time.monotonic())

    @classmethod
    def from_engine_args(cls, args: EngineArgs, stat_loggers: list[StatLogger] | None = None,
                         stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S) -> "AsyncLLM":
        return cls(args, stat_loggers, stall_timeout_s)

    @property
    def engine_pid(self) -> int | None:
        """The engine-core process's pid (for supervisors, and tests that kill or freeze it)."""
        return self._process.pid

    def _wait_until_ready(self) -> int:
        sync_socket = zmq.Socket.shadow(self._output.underlying)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if sync_socket.poll(200):
                message = output_decoder.decode(sync_socket.recv())
                if isinstance(message, Ready):
                    logger.info("engine core ready (pid %d): %d KV blocks", self._process.pid, message.num_blocks)
                    return message.num_blocks
                if isinstance(message, StartupFailed):
                    self._process.join(timeout=10)
                    raise RuntimeError(f"engine core failed to start: {message.error}")
            elif not self._process.is_alive():
                raise RuntimeError(f"engine core exited during start-up (exit code {self._process.exitcode})")
        self.shutdown()
        raise RuntimeError(f"engine core did not become ready within {STARTUP_TIMEOUT_S:.0f} s")

    # -- requests -------------------------------------------------------------------------------

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, as its output_kind says (n > 1: all sequences in one output);
        stopping the iteration aborts it in the engine."""
        self._raise_if_dead()
        self._ensure_output_task()
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request, text = self.processor.process(request_id, prompt, sampling_params)
        core_requests = self.output_processor.add_request(request, text)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            # Inside the try: a cancellation between the sends still withdraws the ones sent.
            for core_request in core_requests:
                await self._input.send(encoder.encode(AddRequest(
                    core_request.request_id, core_request.prompt_token_ids, core_request.sampling_params,
                    sorted(core_request.eos_token_ids), core_request.max_tokens, core_request.arrival_time)))
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the consumer went away (client disconnect, cancellation)
                self._abort_now([request_id])

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        outputs = self._abort_now([request_id])
        if queue is not None:
            for out in outputs:
                queue.put_nowait(out)

    def _abort_now(self, request_ids: list[str]) -> list[RequestOutput]:
        stats = IterationStats()
        core_ids = self.output_processor.core_request_ids(request_ids)
        outputs = self.output_processor.abort(request_ids, stats)
        if outputs and not self._dead_reason:
            self._send_abort(core_ids)
            self._log_stats(stats)
        return outputs

    def _send_abort(self, core_request_ids: list[str]) -> None:
        # A plain (non-awaited) send: this also runs from generators' `finally` during cancellation.
        self._input.send(encoder.encode(AbortRequests(core_request_ids)), flags=zmq.NOBLOCK)

    # -- the output loop --------------------------------------------------------------------------

    def _ensure_output_task(self) -> None:
        # Restarted when done: each asyncio.run() (tests, scripts) ends the previous loop's task.
        if self._dead_reason is None and (self._output_task is None or self._output_task.done()):
            self._output_task = asyncio.get_running_loop().create_task(self._output_loop())

    async def _output_loop(self) -> None:
        """Hand outputs to their requests and watch the core's liveness, until it is dead."""
        poller = zmq.asyncio.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self._heartbeats, zmq.POLLIN)
        try:
            while True:
                await poller.poll(int(HEARTBEAT_INTERVAL_S * 1000))
                while await self._output.poll(0):
                    message = output_decoder.decode(await self._output.recv())
                    if isinstance(message, CoreOutputs):
                        self._handle(message)
                # Every pending heartbeat is read before judging: after this process was busy for a
                # while, queued heartbeats are not silence.
                now = time.monotonic()
                while await self._heartbeats.poll(0):
                    beat = heartbeat_decoder.decode(await self._heartbeats.recv())
                    self._liveness.on_heartbeat(beat.num_steps, now)
                failure = self._failure(now)
                if failure is not None:
                    self._fail_all(failure)
                    return
        except Exception as e:  # a bug here must fail requests, not leave them waiting forever
            logger.exception("engine output loop failed")
            self._fail_all(f"engine output loop failed: {type(e).__name__}: {e}")

    def _failure(self, now: float) -> str | None:
        if not self._process.is_alive():
            return f"engine core process exited (exit code {self._process.exitcode})"
        return self._liveness.failure(now)

    def _handle(self, message: CoreOutputs) -> None:
        self._stats = message.stats
        for core_request_id, error in message.rejected:
            # A rejected child fails its whole parent: its siblings are withdrawn too.
            request_id = self.output_processor.caller_request_id(core_request_id)
            siblings = [i for i in self.output_processor.core_request_ids([request_id]) if i != core_request_id]
            self.output_processor.abort([request_id])
            if siblings and not self._dead_reason:
                self._send_abort(siblings)
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(ValueError(error))
        stats = IterationStats()
        processed = self.output_processor.process(message.outputs, stats)
        if processed.reqs_to_abort and not self._dead_reason:
            self._send_abort(processed.reqs_to_abort)  # ended by a stop string; the core would go on
        for out in processed.request_outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        self._log_stats(stats)

    def _log_stats(self, stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(self._stats, stats)

    def _fail_all(self, reason: str) -> None:
        logger.error("%s; failing %d in-flight requests", reason, len(self._queues))
        self._dead_reason = reason
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))

    def _raise_if_dead(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    async def wait_until_dead(self) -> str:
        """Watch the core from now on (not only once a request comes) and return why it died."""
        self._ensure_output_task()
        if self._dead_reason is None:
            await asyncio.shield(self._output_task)
        return self._dead_reason or "engine output loop ended"

    # -- state and shutdown -------------------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._dead_reason is None and self._process.is_alive()

    def shutdown(self) -> None:
        if self._process.is_alive() and self._dead_reason is None:
            try:
                zmq.Socket.shadow(self._input.underlying).send(encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._process.join(timeout=10)
        if self._process.is_alive():  # a frozen or stalled core would not act on SIGTERM (or Shutdown)
            self._process.kill()
            self._process.join(timeout=5)
        if self._output_task is not None:
            self._output_task.cancel()
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._heartbeats.close(linger=0)
        self._ctx.term()
        self._ipc_dir.cleanup()
