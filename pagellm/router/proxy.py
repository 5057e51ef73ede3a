"""Send a request to a backend of its model: failover with one retry before the first byte, then
the response passed through (a stream chunk by chunk) and its accounting when it ends.

A connect error, a timeout before the response, or a 502/503/504 counts against the backend and
the request goes once to another backend of the model (another of the same version first, as the
balancer picks). Once a byte has gone to the client nothing is retried: a stream that breaks ends
with an error event, which OpenAI clients raise on.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pagellm.entrypoints.openai.errors import APIError, sse_error
from pagellm.router.balance import Backend, ModelRoute
from pagellm.router.client import UPSTREAM_ERRORS, is_timeout
from pagellm.router.state import RouterState

RETRY_STATUSES = frozenset({502, 503, 504})
MAX_ATTEMPTS = 2
"""The first backend and one retry on another."""
FORWARDED_HEADERS = ("x-request-id",)

OnDone = Callable[[int, bytes | None], Awaitable[None]]
"""Called once when the response ends: (output tokens, the full body to cache, or None)."""


@dataclass(slots=True)
class Upstream:
    backend: Backend
    response: aiohttp.ClientResponse
    started: float


async def open_upstream(state: RouterState, route: ModelRoute, path: str, body: dict, client_headers: dict[str, str],
                        hashes: list[int], sticky: str | None, load_tokens: int) -> Upstream:
    """The first backend response (headers read, body not) or APIError 503 when none answered."""
    exclude: set[Backend] = set()
    last_error = "no backend is configured"
    model = route.config.name
    for attempt in range(MAX_ATTEMPTS):
        choice = route.choose(hashes, sticky, frozenset(exclude))
        if choice is None:
            break
        backend, config = choice
        if attempt:
            state.metrics.failovers.labels(model, backend.url).inc()
        headers = {k: v for k, v in client_headers.items() if k in FORWARDED_HEADERS}
        if config.api_key:
            headers["authorization"] = f"Bearer {config.api_key}"
        backend.in_flight += 1
        backend.outstanding_tokens += load_tokens
        state.metrics.in_flight.labels(backend.url).set(backend.in_flight)
        started = time.monotonic()
        try:
            # Headers read, body not; a redirect goes to the client as the backend sent it, not followed.
            response = await state.http.post(backend.url + path, json=body, headers=headers, allow_redirects=False)
        except UPSTREAM_ERRORS as e:
            last_error = f"{backend.url}: {type(e).__name__}"
            kind = "timeout" if is_timeout(e) else "connect"
        except BaseException:  # the client went away while waiting: not the backend's failure
            release_load(state, backend, load_tokens)
            raise
        else:
            state.metrics.first_byte.labels(model, backend.url).observe(time.monotonic() - started)
            if response.status not in RETRY_STATUSES:
                backend.remember(hashes)
                state.backend_succeeded(backend)
                return Upstream(backend, response, started)
            kind = f"http_{response.status}"
            state.metrics.errors.labels(model, backend.url, kind).inc()
            state.backend_failed(backend)
            if attempt == MAX_ATTEMPTS - 1:  # no retry left: the client gets the backend's own answer
                return Upstream(backend, response, started)
            response.close()
            release_load(state, backend, load_tokens)
            last_error = f"{backend.url}: HTTP {response.status}"
            exclude.add(backend)
            continue
        release_load(state, backend, load_tokens)
        state.metrics.errors.labels(model, backend.url, kind).inc()
        state.backend_failed(backend)
        exclude.add(backend)
    raise APIError(f"no backend of model {model!r} answered ({last_error})", 503)


def release_load(state: RouterState, backend: Backend, load_tokens: int) -> None:
    backend.in_flight -= 1
    backend.outstanding_tokens -= load_tokens
    state.metrics.in_flight.labels(backend.url).set(backend.in_flight)


def output_tokens_of(body: bytes) -> int:
    """`usage.completion_tokens` of a JSON response (0 when absent)."""
    try:
        usage = json.loads(body).get("usage") or {}
    except (ValueError, AttributeError):
        return 0
    tokens = usage.get("completion_tokens", 0)
    return tokens if isinstance(tokens, int) else 0


async def respond(state: RouterState, up: Upstream, model: str, stream: bool, load_tokens: int,
                  headers: dict[str, str], on_done: OnDone) -> Response:
    """The client's response: the backend's whole body, or its stream passed through."""
    is_sse = up.response.headers.get("content-type", "").startswith("text/event-stream")
    if not (stream and is_sse):
        try:
            content = await up.response.read()
        except UPSTREAM_ERRORS as e:
            finish(state, up, model, load_tokens, error=type(e).__name__)
            await on_done(0, None)
            raise APIError(f"backend {up.backend.url} broke off its response ({type(e).__name__})", 502) from e
        except BaseException:  # the client went away while waiting
            release_load(state, up.backend, load_tokens)
            raise
        finally:
            up.response.release()  # back to the pool when read whole, else closed
        finish(state, up, model, load_tokens)
        await on_done(output_tokens_of(content), content)
        return Response(content, up.response.status, headers,
                        media_type=up.response.headers.get("content-type", "application/json"))
    relay = _Relay(state, up, model, load_tokens, on_done)
    return _RelayResponse(relay, up.response.status, headers)


@dataclass(slots=True)
class _Relay:
    """A backend's stream passed to the client chunk by chunk, and its accounting when it ends."""

    state: RouterState
    up: Upstream
    model: str
    load_tokens: int
    on_done: OnDone
    started: bool = False

    async def chunks(self) -> AsyncIterator[bytes]:
        self.started = True
        chunks: list[bytes] = []
        events, usage_tokens, error = 0, None, None
        up = self.up
        try:
            async for chunk in up.response.content.iter_any():  # decoded: a gzip-ing backend streams plain SSE too
                chunks.append(chunk)
                events += chunk.count(b"data: ")
                if b'"usage"' in chunk:  # the last chunk of a stream with include_usage
                    usage_tokens = _stream_usage(chunk) or usage_tokens
                yield chunk
        except UPSTREAM_ERRORS as e:
            error = type(e).__name__
            yield sse_error(APIError(f"backend {up.backend.url} broke off the stream ({error})", 502)).encode()
        finally:
            up.response.release()  # back to the pool when read whole, else closed (which aborts the request)
            finish(self.state, up, self.model, self.load_tokens, error=error)
            complete = error is None and b"data: [DONE]" in b"".join(chunks[-2:])
            # Each event but [DONE] carries about one token: an estimate where the stream reports no usage.
            tokens = usage_tokens if usage_tokens is not None else max(0, events - 2)
            await self.on_done(tokens, b"".join(chunks) if complete else None)

    async def abandon(self) -> None:
        """The response ended before its first chunk was asked for (the client went away): the
        stream never started, so its `finally` will not run; close the backend's request here."""
        if not self.started:
            self.started = True
            self.up.response.release()
            finish(self.state, self.up, self.model, self.load_tokens)
            await self.on_done(0, None)


class _RelayResponse(StreamingResponse):
    """The relay's stream as the client's response; the relay is closed however the response ends."""

    def __init__(self, relay: _Relay, status: int, headers: dict[str, str]) -> None:
        super().__init__(relay.chunks(), status, headers, media_type="text/event-stream")
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.abandon()


def _stream_usage(chunk: bytes) -> int | None:
    for line in chunk.split(b"\n"):
        if line.startswith(b"data: {") and b'"usage"' in line:
            tokens = output_tokens_of(line[len(b"data: "):])
            if tokens:
                return tokens
    return None


def finish(state: RouterState, up: Upstream, model: str, load_tokens: int, error: str | None = None) -> None:
    release_load(state, up.backend, load_tokens)
    url = up.backend.url
    state.metrics.requests.labels(model, url, str(up.response.status)).inc()
    state.metrics.latency.labels(model, url).observe(time.monotonic() - up.started)
    if error is not None:
        state.metrics.errors.labels(model, url, "broken_stream").inc()
        state.backend_failed(up.backend)
