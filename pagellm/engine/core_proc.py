"""The engine core in its own process: receives requests over ZMQ, steps, sends outputs back.

Keeping the step loop out of the API process means HTTP parsing, tokenization, detokenization
and SSE never delay a GPU step, and a stalled event loop never stalls the engine.
"""
from __future__ import annotations

import logging
import os
import signal

import zmq

from pagellm.config import EngineArgs
from pagellm.core.request import Request, RequestStatus
from pagellm.engine.core import EngineCore
from pagellm.engine.wire import (
    AbortRequests,
    AddRequest,
    CoreOutputs,
    Ready,
    Shutdown,
    StartupFailed,
    encoder,
    input_decoder,
)

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
"""An idle core still sends (empty) outputs this often, so the API process can tell it is alive."""


def run_engine_core(args: EngineArgs, input_address: str, output_address: str) -> None:
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
            core = EngineCore(args.create_engine_config())
        except Exception as e:  # any start-up failure is reported to the API process, then we exit
            logger.exception("engine core failed to start")
            outputs.send(encoder.encode(StartupFailed(f"{type(e).__name__}: {e}")))
            return
        outputs.send(encoder.encode(Ready(core.num_blocks)))
        _loop(core, inputs, outputs)
    finally:
        outputs.close(linger=1000)
        inputs.close(linger=0)
        ctx.term()


def _loop(core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    parent_pid = os.getppid()
    while True:
        if os.getppid() != parent_pid:
            # The API process died without telling us (SIGKILL, crash): don't linger as an orphan.
            logger.error("API process %d is gone; engine core exiting", parent_pid)
            return
        # Block for input only when there is nothing to step.
        timeout_ms = 0 if core.has_unfinished_requests() else int(HEARTBEAT_INTERVAL_S * 1000)
        rejected: list[tuple[str, str]] = []
        while poller.poll(timeout_ms):
            message = input_decoder.decode(inputs.recv())
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AbortRequests):
                core.abort_requests(message.request_ids)
            elif isinstance(message, AddRequest):
                try:
                    core.add_request(_to_request(message))
                except ValueError as e:
                    rejected.append((message.request_id, str(e)))
            timeout_ms = 0
        step_outputs = core.step() if core.has_unfinished_requests() else []
        outputs.send(encoder.encode(CoreOutputs(step_outputs, core.stats(), rejected)))


def _to_request(message: AddRequest) -> Request:
    return Request(
        request_id=message.request_id,
        prompt_token_ids=message.prompt_token_ids,
        sampling_params=message.sampling_params,
        eos_token_ids=frozenset(message.eos_token_ids),
        max_tokens=message.max_tokens,
        arrival_time=message.arrival_time,
        status=RequestStatus.WAITING,
    )
