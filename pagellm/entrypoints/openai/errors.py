"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every failure.

FastAPI's own 422 body for invalid requests is replaced by a 400 in this shape, which is what
OpenAI clients parse into `BadRequestError`.
"""
from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
                500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """A request the server answers with an error; 400 unless told otherwise."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param


def error_body(message: str, status_code: int, param: str | None = None) -> dict:
    error_type = _ERROR_TYPES.get(status_code) or HTTPStatus(status_code).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": error_type, "param": param, "code": status_code}}


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.status_code, error.param), status_code=error.status_code)


def sse_error(error: APIError) -> str:
    """An error that happens after a stream has started, as one more server-sent event."""
    return f"data: {json.dumps(error_body(error.message, error.status_code, error.param))}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        # loc starts with "body"; a JSON syntax error has no field.
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})")
            continue
        loc = ".".join(str(p) for p in err.get("loc", ())[1:])
        param = param or loc or None
        parts.append(f"{loc or 'body'}: {err['msg']}")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(APIError(message, 400, param))

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return error_response(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500))
