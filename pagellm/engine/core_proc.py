"""The engine core in its own process: receives requests over ZMQ, steps, sends outputs back.

Keeping the step loop out of the API process means HTTP parsing, tokenization, detokenization
and SSE never delay a GPU step, and a stalled event loop never stalls the engine.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import msgspec
import zmq

from pagellm.config import EngineConfig
from pagellm.core.request import EngineCoreRequest
from pagellm.engine.core import EngineCore
from pagellm.engine.wire import (
    AbortRequests,
    CoreOutputs,
    EngineFailed,
    Heartbeat,
    Ready,
    Shutdown,
    StartupFailed,
    encoder,
    input_decoder,
)

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.2
"""The heartbeat thread sends a Heartbeat this often, also while a long step runs."""
IDLE_POLL_S = 0.5
"""An idle core waits this long for input, then sends (empty) outputs so the API process's stats stay fresh."""


@dataclass
class _Progress:
    """Written by the loop, read by the heartbeat thread (a plain int: atomic under the GIL)."""

    num_steps: int = 0


def run_engine_core(config: EngineConfig, input_address: str, output_address: str, heartbeat_address: str) -> None:
    """Process entry point: build the engine, report readiness, then loop until told to stop."""
    # The API process owns Ctrl-C and SIGTERM handling; it tells the core to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [core] %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_address)
    try:
        try:
            core = EngineCore(config)
        except ValueError as e:  # a bad setting: its message says which flag to change, a traceback nothing more
            logger.error("engine core failed to start: %s", e)
            outputs.send(encoder.encode(StartupFailed(str(e), bad_setting=True)))
            return
        except Exception as e:  # any other start-up failure is reported to the API process, then we exit
            logger.exception("engine core failed to start")
            outputs.send(encoder.encode(StartupFailed(f"{type(e).__name__}: {e}")))
            return
        progress, stop = _Progress(), threading.Event()
        heartbeat = threading.Thread(target=_send_heartbeats, args=(ctx, heartbeat_address, progress, stop),
                                     name="pagellm-heartbeat", daemon=True)
        heartbeat.start()
        outputs.send(encoder.encode(Ready(core.num_blocks, core.startup_phases, time.time())))
        try:
            _loop(core, inputs, outputs, progress)
        except Exception as e:
            # The API process fails the requests with this reason, not merely "exited with code 1".
            outputs.send(encoder.encode(EngineFailed(f"{type(e).__name__}: {e}")))
            raise
        finally:
            stop.set()
            heartbeat.join()
            core.shutdown()
    finally:
        outputs.close(linger=1000)
        inputs.close(linger=0)
        ctx.term()


def _send_heartbeats(ctx: zmq.Context, address: str, progress: _Progress, stop: threading.Event) -> None:
    """Heartbeats on a socket of this thread's own (zmq sockets are not thread-safe), until `stop`.

    A thread rather than the loop: a step may take seconds, and the API process must still tell
    a slow core (heartbeats, same step count) from a dead or frozen one (no heartbeats)."""
    sock = ctx.socket(zmq.PUSH)
    sock.connect(address)
    heartbeat_encoder = msgspec.msgpack.Encoder()  # encoders keep a buffer: one per thread
    try:
        while True:
            try:
                sock.send(heartbeat_encoder.encode(Heartbeat(progress.num_steps)), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the API process is not reading; a missed heartbeat is exactly what it should see
            if stop.wait(HEARTBEAT_INTERVAL_S):
                return
    finally:
        sock.close(linger=0)


def _loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, progress: _Progress) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    parent_pid = os.getppid()
    while True:
        if os.getppid() != parent_pid:
            # The API process died without telling us (SIGKILL, crash): don't linger as an orphan.
            logger.error("API process %d is gone; engine core exiting", parent_pid)
            return
        # Block for input only when there is nothing to step.
        timeout_ms = 0 if core.has_unfinished_requests() else int(IDLE_POLL_S * 1000)
        rejected: list[tuple[str, str]] = []
        while poller.poll(timeout_ms):
            message = input_decoder.decode(inputs.recv())
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            elif isinstance(message, EngineCoreRequest):
                try:
                    core.add_request(message)
                except ValueError as e:
                    rejected.append((message.request_id, str(e)))
            timeout_ms = 0
        if core.has_unfinished_requests():
            step_outputs = core.step()
            rejected += core.take_rejected()
        else:
            core.check_health()  # a rank that dies while idle fails the engine now, not at the next request
            step_outputs = []
        outputs.send(encoder.encode(CoreOutputs(step_outputs, core.stats(), rejected)))
        progress.num_steps += 1

