"""Catalogues of bad requests: a case (what to send, the 4xx it must get and what its message must say),
sending one to a live server, and checking its answer against the route's error shape (OpenAI's, or
Anthropic's on /v1/messages*). tests/test_validation_catalogue.py and tests/adversarial/ use them."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httpx

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
"""Routes whose errors take Anthropic's shape (documented in docs/serving.md#errors)."""
OPENAI_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                      405: "MethodNotAllowedError", 413: HTTPStatus(413).phrase.replace(" ", "") + "Error"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                         405: "api_error", 413: "request_too_large"}
TIMEOUT_S = 60.0
"""Per HTTP call: generous, because the CPU may be shared with other test processes."""

Body = dict | list | bytes | Callable[[], Iterator[bytes]] | None


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: Body
    """A dict or list sent as JSON, raw bytes sent as application/json, a callable giving chunks
    (chunked), or None (no body)."""
    status: int
    message: str
    """A piece of the error message that tells the user what to fix."""
    param: str | None = None
    """The field OpenAI's shape names (Anthropic's shape has none: None there)."""
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def send(url: str, case: Case, request_id: str, headers: dict[str, str] | None = None) -> httpx.Response:
    """`case` sent to the server at `url` with X-Request-Id `request_id` (and `headers`, e.g. the API key;
    the case's own headers win)."""
    all_headers = {**(headers or {}), "X-Request-Id": request_id, **case.headers}
    if isinstance(case.body, (dict, list)):
        kwargs: dict[str, Any] = {"json": case.body}
    elif isinstance(case.body, bytes):
        kwargs = {"content": case.body}
        all_headers.setdefault("content-type", "application/json")
    elif callable(case.body):
        kwargs = {"content": case.body()}
        all_headers["content-type"] = "application/json"
    else:
        kwargs = {}
    return httpx.request(case.method, f"{url}{case.path}", headers=all_headers, timeout=TIMEOUT_S, **kwargs)


def mismatch(case: Case, response: httpx.Response, request_id: str) -> str | None:
    """What is wrong with `response` to `case`, or None: its status, the route's error shape with the
    expected type (and param, in OpenAI's), a message that says what to fix and quotes the request id."""
    if response.headers.get("X-Request-Id") != request_id:
        return f"X-Request-Id {response.headers.get('X-Request-Id')!r}, expected {request_id!r}"
    try:
        body = response.json()
        error = body["error"]
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code}, not an error body: {response.text[:200]!r}"
    if case.path in ANTHROPIC_PATHS:
        expected = {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES[case.status],
                                               "message": error.get("message")}, "request_id": request_id}
        if response.status_code != case.status or body != expected:
            return f"{response.status_code} {body}, expected {case.status} in Anthropic's shape"
    elif (response.status_code, set(error)) != (case.status, {"message", "type", "param", "code"}) or (
            error["code"], error["param"], error["type"]) != (case.status, case.param, OPENAI_ERROR_TYPES[case.status]):
        return f"{response.status_code} {error}, expected {case.status} with param {case.param!r}"
    message = error.get("message") or ""
    if case.message not in message or f"(request id: {request_id})" not in message:
        return f"message {message!r} lacks {case.message!r} or the request id"
    return None
