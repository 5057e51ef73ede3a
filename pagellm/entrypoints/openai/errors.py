"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure.

FastAPI's own 422 body for invalid requests is replaced by a 400 in this shape, which is what
OpenAI clients parse into `BadRequestError`; the published OpenAPI schema says so too. Each error
message ends with the request's id (`X-Request-Id`, set by middleware.py), and each error is
logged with it, so a user can quote the id and an operator can find the request.

The Anthropic Messages routes (ANTHROPIC_PATHS) answer in Anthropic's documented shape instead,
`{"type": "error", "error": {"type", "message"}, "request_id"}`, with the same status codes: the
shape is chosen by path here, so errors raised by the middleware (401, 413, 503) get it too, and
the OpenAPI schema documents each route's.
"""
from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException
from starlette.types import Scope

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""nginx's status for a client that went away before the response: not the client's error (400)
nor the server's (5xx), so error counts stay clean."""
_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                CLIENT_CLOSED_REQUEST: "ClientClosedRequest", 500: "InternalServerError",
                503: "ServiceUnavailableError"}
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                          503: "overloaded_error", 504: "timeout_error"}
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
"""Routes whose errors take Anthropic's shape."""
NAMED_EVENT_PATHS = ANTHROPIC_PATHS | {"/v1/responses"}
"""Routes whose streams are named events (`event: <type>`) that end without `data: [DONE]`."""
REQUEST_ID_SCOPE_KEY = "pagellm.request_id"
"""Where RequestIdMiddleware keeps the request's id in the ASGI scope."""


class APIError(Exception):
    """A request the server answers with an error; 400 unless told otherwise."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param


class ErrorInfo(BaseModel):
    message: str
    """What went wrong and how to fix it, ending with `(request id: ...)`."""
    type: str
    param: str | None
    """The request field at fault, if one is."""
    code: int
    """The HTTP status."""


class ErrorResponse(BaseModel):
    """The body of every error response (OpenAI's shape)."""

    error: ErrorInfo


class AnthropicErrorInfo(BaseModel):
    type: str
    """invalid_request_error, authentication_error, not_found_error, overloaded_error, ..."""
    message: str
    """What went wrong and how to fix it, ending with `(request id: ...)`."""


class AnthropicErrorResponse(BaseModel):
    """The body of every error response on ANTHROPIC_PATHS (Anthropic's shape)."""

    type: Literal["error"]
    error: AnthropicErrorInfo
    request_id: str | None
    """The request's id, as in the X-Request-Id header."""


def request_id_of(scope: Scope) -> str | None:
    """The id RequestIdMiddleware gave this request (None outside it)."""
    return scope.get(REQUEST_ID_SCOPE_KEY)


def error_body(message: str, status_code: int, param: str | None = None, request_id: str | None = None,
               path: str | None = None) -> dict:
    """The error's body in the shape the route at `path` uses (OpenAI's unless an Anthropic route)."""
    if request_id is not None:
        message = f"{message} (request id: {request_id})"
    if path in ANTHROPIC_PATHS:
        return {"type": "error", "error": {"type": _ANTHROPIC_ERROR_TYPES.get(status_code, "api_error"),
                                           "message": message}, "request_id": request_id}
    error_type = _ERROR_TYPES.get(status_code) or HTTPStatus(status_code).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(error: APIError, request_id: str | None = None, path: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.status_code, error.param, request_id, path),
                        status_code=error.status_code)


def sse_error(error: APIError, request_id: str | None = None, path: str | None = None) -> str:
    """An error that happens after a stream has started, as one more server-sent event: an `error`
    event on the named-event routes (a Responses one also carries OpenAI's `error` object, which the
    openai client raises on)."""
    body = error_body(error.message, error.status_code, error.param, request_id, path)
    if path in ANTHROPIC_PATHS:
        return f"event: error\ndata: {json.dumps(body)}\n\n"
    if path in NAMED_EVENT_PATHS:
        event = {"type": "error", "code": str(error.status_code), "message": body["error"]["message"],
                 "param": error.param, **body}
        return f"event: error\ndata: {json.dumps(event)}\n\n"
    return f"data: {json.dumps(body)}\n\n"


def log_and_respond(scope: Scope, error: APIError | HTTPException) -> JSONResponse:
    """`error` as a response quoting the request's id, logged with that id: a 500 (a fault of the
    server's own) as an error with its traceback, when called while handling the exception; another
    5xx (the engine died, the server is full or shutting down) as a warning, without one (it would
    repeat the same stack for every request in flight); a 4xx as information."""
    if isinstance(error, HTTPException):
        error = APIError(str(error.detail), error.status_code)
    request_id = request_id_of(scope)
    status = error.status_code
    level = logging.ERROR if status == 500 else logging.WARNING if status > 500 else logging.INFO
    logger.log(level, "%s %s -> %d [request id %s]: %s", scope.get("method"), scope.get("path"), status,
               request_id, error.message, exc_info=status == 500)
    return error_response(error, request_id, scope.get("path"))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        # loc starts with "body"; a JSON syntax error has no field.
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ())[1:])
        # A model-level check (protocol.py) names the field it faults, under the model, in ctx["param"].
        field = ".".join(p for p in (loc, (err.get("ctx") or {}).get("param")) if p)
        param = param or field or None
        parts.append(f"{field or 'body'}: {err['msg']}")
    return "; ".join(parts) or "invalid request", param


def _unparsable_body_message(cause: BaseException) -> str:
    """Why FastAPI could not read the body as JSON (it reports only 'error parsing the body')."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset "
                f"{cause.start}); send JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body's JSON is nested too deeply"
    return f"the request body could not be parsed as JSON: {cause}"


def install_error_handlers(app: FastAPI) -> None:
    """OpenAI-shaped errors for APIError, validation and HTTP errors, and an OpenAPI schema that
    documents them. Unexpected exceptions are RequestIdMiddleware's (a 500 carrying the id)."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return log_and_respond(request.scope, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        content_type = request.headers.get("content-type", "")
        if content_type and "json" not in content_type:
            return log_and_respond(request.scope, APIError(
                f"send the request body as JSON with `Content-Type: application/json`, not `{content_type}`"))
        message, param = _validation_message(exc)
        return log_and_respond(request.scope, APIError(message, 400, param))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI failed to decode the body
            return log_and_respond(request.scope, APIError(_unparsable_body_message(exc.__cause__)))
        return log_and_respond(request.scope, exc)

    app.openapi = lambda: _openapi_with_error_shapes(app)


def _openapi_with_error_shapes(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the route's error shape (OpenAI's, or Anthropic's on ANTHROPIC_PATHS)
    instead of its 422 validation error: 400 for invalid requests, 404 for an unknown model, 413 for
    a body over the limit."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path, path_item in schema["paths"].items():
            shape = AnthropicErrorResponse if path in ANTHROPIC_PATHS else ErrorResponse
            error_ref = {"$ref": f"#/components/schemas/{shape.__name__}"}
            for operation in path_item.values():
                responses = operation["responses"]
                if responses.pop("422", None) is None:
                    continue
                for status, description in (("400", "Invalid request"), ("404", "Unknown model"),
                                            ("413", "Request body too large")):
                    responses[status] = {"description": description,
                                         "content": {"application/json": {"schema": error_ref}}}
        _, definitions = models_json_schema([(ErrorResponse, "serialization"),
                                             (AnthropicErrorResponse, "serialization")],
                                            ref_template="#/components/schemas/{model}")
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components.update(definitions["$defs"])
        app.openapi_schema = schema
    return app.openapi_schema
