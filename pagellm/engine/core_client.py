"""One engine-core process as the API process sees it: its sockets, its liveness, its latest stats.

The core runs `core_proc.run_engine_core`; requests go in over one ZMQ socket, outputs and
heartbeats come back over two others. `AsyncLLM` holds one client per data-parallel replica.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import tempfile
import time

import zmq
import zmq.asyncio

from pagellm.config import EngineConfig
from pagellm.core.outputs import SchedulerStats
from pagellm.engine.core_proc import run_engine_core
from pagellm.engine.liveness import LivenessMonitor
from pagellm.engine.wire import Ready, Shutdown, StartupFailed, encoder, output_decoder

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Longest wait for a core to load the model and size its cache."""


class CoreClient:
    """Engine-core process number `index`, started by the constructor; `wait_until_ready` next."""

    def __init__(self, config: EngineConfig, index: int, ctx: zmq.asyncio.Context,
                 stall_timeout_s: float | None) -> None:
        self.index = index
        self.liveness = LivenessMonitor(stall_timeout_s)
        self.stats = SchedulerStats()
        self.num_blocks = 0
        self.startup_phases: dict[str, float] = {}
        """The engine core's start-up phases, from its ready message."""
        self.ready = False
        """Whether the core has reported ready (it serves from then on)."""
        self.ready_at = 0.0
        """time.perf_counter() when the core sent its ready message (once `ready`)."""
        self.failure_reason: str | None = None
        """Why this core was found dead; None while it serves."""
        self.load = 0
        """Tokens this replica still has to process for the requests routed to it (prompt plus
        max_tokens each), counted in the API process: what routing balances."""
        self._ipc_dir = tempfile.TemporaryDirectory(prefix=f"pagellm-core{index}-")
        input_address = f"ipc://{os.path.join(self._ipc_dir.name, 'input')}"
        output_address = f"ipc://{os.path.join(self._ipc_dir.name, 'output')}"
        heartbeat_address = f"ipc://{os.path.join(self._ipc_dir.name, 'heartbeat')}"
        self.input = ctx.socket(zmq.PUSH)
        self.input.bind(input_address)
        self.output = ctx.socket(zmq.PULL)
        self.output.bind(output_address)
        self.heartbeats = ctx.socket(zmq.PULL)
        self.heartbeats.bind(heartbeat_address)
        # spawn, not fork: the child must not inherit this process's threads or CUDA state.
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(config, input_address, output_address, heartbeat_address),
            name=f"pagellm-engine-core-{index}", daemon=True)
        self.process.start()

    def wait_until_ready(self) -> None:
        """Block until the core reports ready; raise with its reason if it fails to start."""
        sync_socket = zmq.Socket.shadow(self.output.underlying)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if sync_socket.poll(200):
                message = output_decoder.decode(sync_socket.recv())
                if isinstance(message, Ready):
                    logger.info("engine core ready (pid %d): %d KV blocks", self.process.pid, message.num_blocks)
                    self.num_blocks = message.num_blocks
                    self.startup_phases = message.startup_phases
                    self.ready = True
                    late_s = time.time() - message.sent_at if message.sent_at is not None else 0.0
                    self.ready_at = time.perf_counter() - max(0.0, late_s)
                    self.liveness.start(time.monotonic())
                    return
                if isinstance(message, StartupFailed):
                    self.process.join(timeout=10)
                    if message.bad_setting:
                        raise ValueError(message.error)
                    raise RuntimeError(f"engine core failed to start: {message.error}")
            elif not self.process.is_alive():
                raise RuntimeError(f"engine core exited during start-up (exit code {self.process.exitcode})")
        raise RuntimeError(f"engine core did not become ready within {STARTUP_TIMEOUT_S:.0f} s")

    def failure(self, now: float) -> str | None:
        """Why this core counts as dead at `now` (after its pending heartbeats were read), or None."""
        if not self.process.is_alive():
            return f"engine core process exited (exit code {self.process.exitcode})"
        return self.liveness.failure(now)

    def shutdown(self, graceful: bool) -> None:
        """Ask the core to exit (when `graceful`), kill it if it has not within seconds, and close.
        A core that has not reported ready is killed at once: it has no requests to finish, and it
        reads no messages until its model is loaded."""
        if self.process.is_alive() and graceful and self.ready:
            try:
                zmq.Socket.shadow(self.input.underlying).send(encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():  # a frozen or stalled core would not act on SIGTERM (or Shutdown)
            self.process.kill()
            self.process.join(timeout=5)
        for sock in (self.input, self.output, self.heartbeats):
            sock.close(linger=0)
        self._ipc_dir.cleanup()
