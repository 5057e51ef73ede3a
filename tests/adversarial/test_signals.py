"""Signals under load, each on a server of its own with the adversary's small capacity (probes.
ADMISSION_FLAGS): a dozen clients on every generation route, streamed and not, some of them waiting for
room, when
* the engine core is killed (SIGKILL) or stopped (SIGSTOP): every client gets a 503 (an error body, or an
  error event ending its stream) within seconds, the server exits with status 1, and no process of its
  tree is left;
* the server gets SIGTERM: requests in flight finish or, past --shutdown-timeout, end with a 503; new
  connections are refused; the server exits with status 0 leaving no process, and logs no traceback.
(tests/test_server_reliability.py checks each failure with one request or none, and how fast /health
notices.)"""
from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import time

import httpx
import pytest
from engine_utils import wait_for
from server_utils import RemoteServer, metric_samples

from adversarial.probes import (
    ADMISSION_FLAGS,
    ENGINE_FLAGS,
    ERROR,
    MAX_NUM_SEQS,
    OK,
    ROUTES,
    STREAM_ERROR,
    Outcome,
    process_tree,
    request_outcome,
    server_faults,
    survivors,
)

pytestmark = pytest.mark.slow  # servers of the real model, killed and stopped

SEED = 5302
NUM_CLIENTS = 12
FAILED_WITHIN_S = 5.0
"""Every client's answer after the engine core is killed or stopped: the server notices within about a
second (a silent heartbeat), plus slack for a loaded machine."""
EXIT_S = 30.0
SHUTDOWN_TIMEOUT_S = 4.0
CUT_GRACE_S = 5.0
"""api_server.CUT_REQUESTS_GRACE_S: how long requests cut at --shutdown-timeout have to end."""


def load_request(rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    path = rng.choice(sorted(ROUTES))
    body = {**ROUTES[path], "stream": rng.random() < 0.6}
    body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = max_tokens
    if path in ("/v1/completions", "/v1/chat/completions"):
        body["ignore_eos"] = True
    return path, body


async def under_load(server: RemoteServer, requests: list[tuple[str, dict]], act) -> list[Outcome]:
    """Send `requests` at once; once the engine runs a full batch, `act()`; every request's outcome."""
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=server.url, timeout=EXIT_S + 60, limits=limits) as http:
        tasks = [asyncio.create_task(request_outcome(http, path, body)) for path, body in requests]
        await wait_for(lambda: metric_samples(server.url)["pagellm:num_requests_running"] >= MAX_NUM_SEQS,
                       timeout_s=60.0)
        act()
        return await asyncio.gather(*tasks)


@contextlib.contextmanager
def serving(smollm2_path: str, *flags: str):
    server = RemoteServer(smollm2_path, *ENGINE_FLAGS, *ADMISSION_FLAGS, *flags)
    core = server.engine_pid()
    try:
        yield server, core
    finally:
        if server.process.poll() is None:  # the test failed: let the server's own shutdown proceed
            with contextlib.suppress(ProcessLookupError):
                os.kill(core, signal.SIGCONT)
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
def test_an_engine_killed_or_stopped_under_load_fails_every_client_at_once(smollm2_path, sig):
    rng = random.Random(SEED)
    with serving(smollm2_path) as (server, core):
        tree = process_tree(server.process.pid)
        signalled: list[float] = []

        def act() -> None:
            os.kill(core, sig)
            signalled.append(time.monotonic())

        outcomes = asyncio.run(under_load(server, [load_request(rng, 400) for _ in range(NUM_CLIENTS)], act))
        answered = time.monotonic() - signalled[0]
        assert all(o.kind in (ERROR, STREAM_ERROR) and o.code == 503 for o in outcomes), outcomes
        assert answered < FAILED_WITHIN_S, f"the last client was answered {answered:.1f} s after the signal"
        assert server.process.wait(timeout=EXIT_S) == 1
        left = survivors(tree)
        assert not left, f"processes left behind: {left}"
        faults = server_faults(server.log_tail(1_000_000))
        assert not faults, faults


def late_request_refused(server: RemoteServer) -> bool:
    """A request sent after the signal: refused (the socket is closed, or a 503 while draining)."""
    try:
        return httpx.post(f"{server.url}/v1/completions", json=ROUTES["/v1/completions"],
                          timeout=EXIT_S).status_code == 503
    except httpx.TransportError:  # refused, or accepted in the instant before the socket closed, then shut
        return True


def test_sigterm_under_load_drains_or_cuts_cleanly_and_leaves_no_process(smollm2_path):
    rng = random.Random(SEED + 1)
    # Short requests finish within --shutdown-timeout; long ones are cut by it.
    requests = [load_request(rng, 8 if i % 2 else 400) for i in range(NUM_CLIENTS)]
    # Requests waiting for room wait past the shutdown (not the adversary's 3 s), so that each one that
    # does not finish is cut by it, not by its queue timeout on a slow machine.
    with serving(smollm2_path, "--shutdown-timeout", f"{SHUTDOWN_TIMEOUT_S:g}", "--queue-timeout", "60") as (server, _):
        tree = process_tree(server.process.pid)
        signalled: list[float] = []

        def act() -> None:
            server.process.send_signal(signal.SIGTERM)
            signalled.append(time.monotonic())

        outcomes = asyncio.run(under_load(server, requests, act))
        answered = time.monotonic() - signalled[0]
        assert late_request_refused(server)
        assert server.process.wait(timeout=EXIT_S) == 0
        left = survivors(tree)
        faults = server_faults(server.log_tail(1_000_000))
    finished = [o for o in outcomes if o.kind == OK]
    cut = [o for o in outcomes if o.kind in (ERROR, STREAM_ERROR)]
    assert len(finished) + len(cut) == len(outcomes), [o for o in outcomes if o not in finished + cut]
    assert finished and cut, outcomes
    not_by_shutdown = [o for o in cut if not (o.code == 503 and "shut" in o.detail)]
    assert not not_by_shutdown, not_by_shutdown
    assert answered < SHUTDOWN_TIMEOUT_S + CUT_GRACE_S, f"the last client was answered {answered:.1f} s after"
    assert not left, f"processes left behind: {left}"
    assert not faults, faults
