"""Messages between the API process and the engine-core process (msgpack via msgspec over ZMQ)."""
from __future__ import annotations

import msgspec

from pagellm.core.outputs import EngineCoreOutput, SchedulerStats
from pagellm.core.request import EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineCoreInput = EngineCoreRequest | AbortRequests | Shutdown
"""A new request goes as its record (`EngineCoreRequest`), exactly as the input processor made it."""


class Ready(msgspec.Struct, tag=True):
    num_blocks: int
    startup_phases: dict[str, float] = {}
    """Seconds of each phase of the engine core's construction (`pagellm.metrics.startup`)."""
    sent_at: float | None = None
    """time.time() when the core sent it: the API process, busy with its own start meanwhile, may
    read it later."""


class StartupFailed(msgspec.Struct, tag=True):
    error: str
    bad_setting: bool = False
    """A ValueError: a setting that does not work with this model or machine (the error names the
    flag), rather than a failure of the engine."""


class CoreOutputs(msgspec.Struct, tag=True):
    """One step's outputs plus the scheduler's stats; sent empty when idle, so the stats stay fresh."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    rejected: list[tuple[str, str]] = []
    """(request_id, error message) of requests the core refused."""


class EngineFailed(msgspec.Struct, tag=True):
    """The step loop raised (a rank died or hung): the core's last message before it exits."""

    error: str


EngineCoreMessage = Ready | StartupFailed | CoreOutputs | EngineFailed


class Heartbeat(msgspec.Struct):
    """Sent by the core's heartbeat thread on its own socket, also while a step runs."""

    num_steps: int
    """Iterations of the core's loop so far (a model step, or an idle wait); stuck = not moving."""


encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(EngineCoreInput)
output_decoder = msgspec.msgpack.Decoder(EngineCoreMessage)
heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)
