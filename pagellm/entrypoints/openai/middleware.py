"""Pure ASGI middlewares at the server's edge: a request id on every response, and a cap on the
request body enforced while the body streams in.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, so streamed responses pass through
untouched and the body is never buffered here.
"""
from __future__ import annotations

import re
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagellm.entrypoints.openai.errors import REQUEST_ID_SCOPE_KEY, APIError, log_and_respond
from pagellm.entrypoints.openai.protocol import REQUEST_ID_PATTERN

REQUEST_ID_HEADER = "X-Request-Id"
_VALID_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)


class RequestIdMiddleware:
    """Gives every HTTP request an id: the client's `X-Request-Id` when it matches
    REQUEST_ID_PATTERN, else a fresh one. The response echoes it as `X-Request-Id`, and error
    bodies and log lines quote it, so a user's report can be matched with the server's log.

    Outermost, so it also turns an unexpected exception into a 500 in OpenAI's shape that
    carries the id (Starlette's own last-resort 500 would be plain text, without it).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(REQUEST_ID_HEADER)
        request_id = given if given is not None and _VALID_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope[REQUEST_ID_SCOPE_KEY] = request_id
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message.setdefault("headers", [])  # optional in ASGI; MutableHeaders needs the list
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = request_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            if started:  # the status line is out: nothing left to tell the client
                raise
            response = log_and_respond(scope, APIError(f"internal server error: {type(e).__name__}: {e}", 500))
            await response(scope, receive, send_with_id)


class BodyTooLarge(HTTPException):
    """Raised from `receive` once the body passes the limit. FastAPI re-raises HTTPExceptions met
    while reading a body, so the app's handler answers it (errors.py); else the middleware does."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes "
                              "(--max-request-body-bytes); send a smaller request")


class BodySizeLimitMiddleware:
    """413 for a body over `max_body_bytes`: at once when Content-Length declares one, else as soon
    as the received chunks pass the limit (chunked transfer has no Content-Length)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await log_and_respond(scope, BodyTooLarge(self.max_body_bytes))(scope, receive, send)
            return
        received = 0
        started = False

        async def receive_limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive_limited, send_tracked)
        except BodyTooLarge as e:
            if started:
                raise
            await log_and_respond(scope, e)(scope, receive, send)
