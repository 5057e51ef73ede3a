"""Traffic control at the server's edge: a bound on generation requests in flight (503 with
`Retry-After` past it), admission by work (admission.py), refusal of new requests while draining for
shutdown, and a per-request deadline (504): the server's `--request-timeout`, which a client may
shorten for one request with the `X-Request-Timeout: <seconds>` header (the smaller of the two applies).

The overload rules, exactly: a request to a generation path is *in flight* from the moment this
middleware starts handling it until its response's last byte is sent (or the client leaves).
While `max_seqs_in_flight + max_waiting_requests` requests are in flight, the next one is refused
at once, before its body is read; each admitted request holds at least one of the
`max_seqs_in_flight` sequences, so this bound never refuses a request that admission would take.
Once parsed, a request is admitted by the sequences and tokens it asks for (admission.py), or waits
for room, or is refused. The checks and counts happen on the server's one event loop with no
`await` between them, so concurrent arrivals cannot both take the last place.
"""
from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.admission import TICKET_SCOPE_KEY, Admission, Ticket
from pagellm.entrypoints.openai.errors import (
    NAMED_EVENT_PATHS,
    APIError,
    error_response,
    log_and_respond,
    request_id_of,
    sse_error,
)
from pagellm.entrypoints.openai.limits import DEFAULT_QUEUE_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S

logger = logging.getLogger(__name__)

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                              "/v1/embeddings"})
"""The paths that occupy the engine, hence counted and bounded in time."""
PROBE_PATHS = frozenset({"/health", "/health/live", "/health/ready", "/metrics", "/version"})
"""Answered even while draining: supervisors and load balancers must see the state."""
TIMEOUT_HEADER = "x-request-timeout"
"""A client's own deadline for one generation request, in seconds (capped by `--request-timeout`)."""
RETRY_AFTER_S = 1
"""`Retry-After` on a 503: short, since room frees up whenever any request finishes."""
SEQS_IN_FLIGHT_PER_SEQ = 2
"""Default `--max-seqs-in-flight` per `--max-num-seqs` the engine runs: as many again wait in its
queue, ready for its next step, so the engine never idles between the server's admissions."""
WAITING_PER_SEQ = 4
"""Default `--max-waiting-requests` per `--max-num-seqs` (1024 for the default 256): room for a burst,
whose wait `--queue-timeout` bounds."""


@dataclass(frozen=True, slots=True)
class TrafficLimits:
    max_seqs_in_flight: int
    """Sequences admitted to the engine at once (`--max-seqs-in-flight`)."""
    max_waiting_requests: int
    """Requests that may wait for room beyond those (`--max-waiting-requests`); 0: none wait."""
    max_tokens_in_flight: int | None = None
    """Tokens (prompt + max_tokens of each sequence) admitted at once (None: no bound)."""
    queue_timeout_s: float | None = None
    """A request still waiting for room after this long gets a 503 (None: it waits until there is room)."""
    request_timeout_s: float | None = None
    """A generation request still unfinished after this long is aborted with a 504 (None: no limit)."""

    def __post_init__(self) -> None:
        if self.max_seqs_in_flight < 1:
            raise ValueError(f"--max-seqs-in-flight must be >= 1, got {self.max_seqs_in_flight}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {self.max_waiting_requests}")
        if self.max_tokens_in_flight is not None and self.max_tokens_in_flight < 1:
            raise ValueError(f"--max-tokens-in-flight must be >= 1, got {self.max_tokens_in_flight}")
        for name, value in (("--queue-timeout", self.queue_timeout_s), ("--request-timeout", self.request_timeout_s)):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive seconds, got {value}")

    @classmethod
    def for_engine(cls, max_num_seqs: int, max_seqs_in_flight: int | None = None,
                   max_waiting_requests: int | None = None, max_tokens_in_flight: int | None = None,
                   queue_timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S,
                   request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S) -> "TrafficLimits":
        """The limits of an engine running `max_num_seqs` sequences at once; None sequences in flight:
        SEQS_IN_FLIGHT_PER_SEQ per sequence it runs; None waiting: WAITING_PER_SEQ per sequence it runs."""
        seqs = SEQS_IN_FLIGHT_PER_SEQ * max_num_seqs if max_seqs_in_flight is None else max_seqs_in_flight
        waiting = WAITING_PER_SEQ * max_num_seqs if max_waiting_requests is None else max_waiting_requests
        return cls(seqs, waiting, max_tokens_in_flight, queue_timeout_s, request_timeout_s)

    @property
    def max_in_flight(self) -> int:
        return self.max_seqs_in_flight + self.max_waiting_requests


@dataclass
class TrafficState:
    """Shared by the middleware, the readiness probe and the shutdown signal handler."""

    limits: TrafficLimits
    in_flight: int = 0
    draining: bool = False
    """Set on SIGINT/SIGTERM: new requests get 503 while the ones in flight finish."""
    on_turned_away: Callable[[str], None] | None = None
    """Told why each generation request was answered without running to its end: "at_capacity",
    "queue_timeout" or "draining" (503), "timed_out" (504); the server counts these in its metrics."""
    admission: Admission = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.limits.max_seqs_in_flight, self.limits.max_tokens_in_flight,
                                   self.limits.max_waiting_requests, self.limits.queue_timeout_s)

    def refusal(self, path: str) -> tuple[str, str] | None:
        """(why, message) when a new request to `path` is refused now; None: it is taken. While
        draining only probes are answered; otherwise only generation requests are bounded."""
        if path in PROBE_PATHS or (path not in GENERATION_PATHS and not self.draining):
            return None
        return self._refusal()

    def not_ready_reason(self) -> str | None:
        """Why a new generation request would be refused now (None: it would be taken), also when
        there is no room for it and no more may wait."""
        refusal = self._refusal()
        if refusal is not None:
            return refusal[1]
        return self.admission.full_reason()

    def _refusal(self) -> tuple[str, str] | None:
        if self.draining:
            return "draining", ("the server is shutting down and takes no new requests; retry on another replica "
                                "or later")
        if self.in_flight >= self.limits.max_in_flight:
            return "at_capacity", (
                f"the server is at capacity ({self.in_flight} requests in flight, the most it takes is "
                f"--max-seqs-in-flight {self.limits.max_seqs_in_flight} + --max-waiting-requests "
                f"{self.limits.max_waiting_requests}); retry after {RETRY_AFTER_S} s")
        return None

    def turned_away(self, why: str) -> None:
        if self.on_turned_away is not None:
            self.on_turned_away(why)


class TrafficMiddleware:
    """Applies TrafficState's refusals and counts, and the request timeout, to HTTP requests."""

    def __init__(self, app: ASGIApp, state: TrafficState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.state.refusal(scope["path"])
        if refusal is not None:
            why, message = refusal
            logger.warning("%s %s -> 503 [request id %s]: %s", scope["method"], scope["path"],
                           request_id_of(scope), message)
            if scope["path"] in GENERATION_PATHS:
                self.state.turned_away(why)
            response = error_response(APIError(message, 503), request_id_of(scope), scope["path"])
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
            await response(scope, receive, send)
            return
        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            timeout_s, source = self._deadline(scope)
        except APIError as error:
            await log_and_respond(scope, error)(scope, receive, send)
            return
        ticket = Ticket(self.state.admission, self.state.turned_away)
        scope[TICKET_SCOPE_KEY] = ticket
        self.state.in_flight += 1
        response = _ResponseProgress(_with_retry_after(send))
        try:
            await self._run_with_deadline(scope, receive, response, timeout_s, source)
        except asyncio.CancelledError:
            if not self.state.draining:
                raise
            # uvicorn cancels what still runs once --shutdown-timeout has passed: end the response
            # validly rather than with a bare EOF, and let no cancellation reach uvicorn, which logs
            # it as a traceback.
            await response.finish_with(APIError("the server shut down before the request finished (its "
                                                "--shutdown-timeout passed); retry it", 503), scope, receive)
        finally:
            ticket.release()
            self.state.in_flight -= 1

    def _deadline(self, scope: Scope) -> tuple[float | None, str]:
        """This request's time limit in seconds (None: none) and what set it, for the 504's message."""
        server_s = self.state.limits.request_timeout_s
        header = Headers(scope=scope).get(TIMEOUT_HEADER)
        if header is None:
            return server_s, "this server's --request-timeout"
        try:
            client_s = float(header)
        except ValueError:
            client_s = math.nan
        if not math.isfinite(client_s) or client_s <= 0:
            raise APIError(f"the X-Request-Timeout header must be a positive number of seconds, got {header!r}",
                           param="X-Request-Timeout")
        if server_s is not None and server_s <= client_s:
            return server_s, "this server's --request-timeout"
        return client_s, "the request's X-Request-Timeout"

    async def _run_with_deadline(self, scope: Scope, receive: Receive, response: _ResponseProgress,
                                 timeout_s: float | None, source: str) -> None:
        if timeout_s is None:
            await self.app(scope, receive, response.send)
            return
        # A task of its own, rather than asyncio.wait_for, so that a TimeoutError raised inside the
        # app is never mistaken for this deadline.
        task = asyncio.ensure_future(self.app(scope, receive, response.send))
        try:
            done, _ = await asyncio.wait((task,), timeout=timeout_s)
        finally:
            if not task.done():  # the deadline passed, or this request was cancelled (server stop)
                task.cancel()
                # Cancelling the handler closes the engine's output stream, which aborts the request
                # and frees its KV blocks: done before this request's response ends.
                await asyncio.gather(task, return_exceptions=True)
        if done:
            task.result()
            return
        error = APIError(f"the request did not finish within {source} of {timeout_s:g} s "
                         "and was aborted; ask for fewer tokens or retry later", 504)
        logger.warning("%s %s -> 504 [request id %s]: %s", scope["method"], scope["path"], request_id_of(scope),
                       error.message)
        self.state.turned_away("timed_out")
        await response.finish_with(error, scope, receive)


def _with_retry_after(send: Send) -> Send:
    """`send` that adds `Retry-After` to a generation request's 503 (no room for it, or the engine is
    gone): a client should retry, here or on another replica, rather than give up."""
    async def send_with_retry_after(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] == 503:
            message.setdefault("headers", [])  # optional in ASGI; MutableHeaders needs the list
            MutableHeaders(scope=message).setdefault("Retry-After", str(RETRY_AFTER_S))
        await send(message)

    return send_with_retry_after


class _ResponseProgress:
    """Follows what a response has sent, so a timed-out one can be ended in a valid way."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.finished = False
        self.streaming = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            self.streaming = Headers(raw=message["headers"]).get("content-type", "").startswith("text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def finish_with(self, error: APIError, scope: Scope, receive: Receive) -> None:
        """`error` as the whole response if none has begun; as a last server-sent event in a stream."""
        if not self.started:
            await error_response(error, request_id_of(scope), scope["path"])(scope, receive, self._send)
        elif not self.finished:
            body = sse_error(error, request_id_of(scope), scope["path"]) if self.streaming else ""
            if self.streaming and scope["path"] not in NAMED_EVENT_PATHS:
                body += "data: [DONE]\n\n"
            await self._send({"type": "http.response.body", "body": body.encode(), "more_body": False})
