"""The OpenAI-compatible HTTP server: the FastAPI app, its routes, and the uvicorn runner.

`python -m pagellm.entrypoints.openai.api_server [MODEL] [flags]` is `pagellm serve`.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pagellm import __version__
from pagellm.config import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.cli import API_KEY_ENV, engine_args_from
from pagellm.entrypoints.openai.errors import APIError, error_response, install_error_handlers, log_and_respond
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.middleware import BodySizeLimitMiddleware, RequestIdMiddleware
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_tokens import OpenAIServingTokens
from pagellm.loader.source import DEFAULT_MODEL_FILE
from pagellm.metrics.log_stats import LoggingStatLogger
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.tokenizer.chat_template import compile_chat_template

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
"""Paths answered without the API key: probes and scrapers carry no credentials."""
GRACEFUL_SHUTDOWN_S = 5
"""How long open streams may run on after SIGINT/SIGTERM before the server closes them."""


def build_app(engine: AsyncLLM, served_model_name: str | Sequence[str], api_key: str | None = None,
              chat_template: str | None = None, metrics: PrometheusStatLogger | None = None,
              limits: ServerLimits | None = None) -> FastAPI:
    """The app serving `engine`; requests may name any of the served names (the first is the default)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    if not names:
        raise ValueError("served_model_name must name at least one model")
    limits = limits or ServerLimits()
    completions = OpenAIServingCompletion(engine, names, chat_template, limits)
    chats = OpenAIServingChat(engine, names, chat_template, limits)
    tokens = OpenAIServingTokens(engine, names, chat_template, limits)

    app = FastAPI(title="pagellm", version=__version__)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # Added last, so outermost: every response (a 401 or 413 too) carries X-Request-Id.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=limits.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(APIError("the engine process is not running", 503))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.config.source.path,
                                         max_model_len=engine.config.max_model_len) for name in names])

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chats.create_chat_completion(request, raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return tokens.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokens.detokenize(request)

    return app


class APIKeyMiddleware:
    """401 for any path but OPEN_PATHS without `Authorization: Bearer <key>`.

    A plain ASGI middleware, not a route dependency, so the key is checked before the body is
    parsed (an unauthenticated client learns nothing from validation errors), and streamed
    responses pass through untouched.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                response = log_and_respond(scope, APIError(
                    "missing or wrong API key: send the header `Authorization: Bearer <key>`", 401))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's content, or the value itself when it is an inline template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{" in value:
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template string")
    compile_chat_template(template)  # a syntax error should stop start-up, not fail every request
    return template


def default_served_name(model: str | None) -> str:
    return model if model is not None else DEFAULT_MODEL_FILE.split(".")[0]


def run_server(ns: argparse.Namespace) -> int:
    """Start the engine process and serve until SIGINT/SIGTERM; `ns` holds `pagellm serve`'s flags."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = engine_args_from(ns)
    names = ns.served_model_name or [default_served_name(args.model)]
    chat_template = load_chat_template(ns.chat_template)
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    # Bind before the model loads, so a busy port fails in a moment rather than after start-up.
    sock = _bind(ns.host, ns.port)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    try:
        asyncio.run(_serve(args, names, chat_template, api_key, sock, ns.uvicorn_log_level,
                           ServerLimits.from_namespace(ns)))
    finally:
        sock.close()
    return 0


async def _serve(args: EngineArgs, names: list[str], chat_template: str | None, api_key: str | None,
                 sock: socket.socket, log_level: str, limits: ServerLimits) -> None:
    bucket_bound = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    metrics = PrometheusStatLogger(names[0], **bucket_bound)
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[metrics, LoggingStatLogger()])
    try:
        app = build_app(engine, names, api_key=api_key, chat_template=chat_template, metrics=metrics, limits=limits)
        host, port = sock.getsockname()[:2]
        logger.info("serving %s on http://%s:%d%s", ", ".join(names), host, port,
                    " (API key required)" if api_key else "")
        config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        await uvicorn.Server(config).serve(sockets=[sock])
    finally:
        engine.shutdown()


def _exit_cleanly(signum: int, frame: object) -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down. Exiting through
    # SystemExit, rather than dying from the signal, runs the `finally` that stops the engine
    # process (also when the signal comes during start-up).
    raise SystemExit(0)


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") from None
    return sock


if __name__ == "__main__":
    from pagellm.entrypoints.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
