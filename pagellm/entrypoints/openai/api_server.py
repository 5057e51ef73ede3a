"""The OpenAI-compatible HTTP server: the FastAPI app, its routes, and the uvicorn runner.

`pagellm serve` (`pagellm.cli.serve`) runs it with the flags of `cli_args`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import time
from collections.abc import Coroutine, Sequence
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pagellm.config.engine import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.gc_freeze import freeze_startup_objects
from pagellm.entrypoints.openai.auth import APIKeyMiddleware
from pagellm.entrypoints.openai.cli_args import API_KEY_ENV, LoRAModule
from pagellm.entrypoints.openai.errors import APIError, error_response, install_error_handlers, request_id_of
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.middleware import BodySizeLimitMiddleware, RequestIdMiddleware
from pagellm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    UnloadLoRAAdapterRequest,
)
from pagellm.entrypoints.openai.protocol_anthropic import CountTokensRequest, CountTokensResponse, MessagesRequest
from pagellm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.served_models import ServedModel, ServedModels, UnknownModelError
from pagellm.entrypoints.openai.server_start import ServerStart
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.openai.serving_messages import AnthropicServingMessages
from pagellm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagellm.entrypoints.openai.serving_tokens import OpenAIServingTokens
from pagellm.entrypoints.openai.traffic import PROBE_PATHS, TrafficLimits, TrafficMiddleware, TrafficState
from pagellm.entrypoints.openai.web_pages import add_web_ui_routes, web_ui_paths
from pagellm.entrypoints.openai.web_ui import STATS_PATH, add_stats_route
from pagellm.loader.source import DEFAULT_MODEL_FILE
from pagellm.metrics import startup
from pagellm.metrics.log_stats import LoggingStatLogger
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.version import __version__

logger = logging.getLogger(__name__)

ENGINE_DEAD_EXIT_CODE = 1
"""The server's exit status after its engine core died, froze or stalled: a supervisor should restart it."""
CUT_REQUESTS_GRACE_S = 5.0
"""How long the requests cut at --shutdown-timeout have to end their responses before the engine stops."""
HEALTHY = {"status": "ok"}
"""The body of a probe's 200 (a 503's is an error in OpenAI's shape)."""


def build_app(engine: AsyncLLM, served_model_name: str | Sequence[str] | ServedModels, api_key: str | None = None,
              chat_template: str | None = None, metrics: PrometheusStatLogger | None = None,
              limits: ServerLimits | None = None, traffic: TrafficState | None = None,
              protect_metrics: bool = False, auto_tool_parser: str | None = None,
              allow_runtime_lora_updating: bool = False, web_ui: bool = True) -> FastAPI:
    """The app serving `engine`; requests may name any of the served names (the first is the default),
    or, given ServedModels, one of its LoRA adapters too.

    `traffic` bounds requests and their work in flight, and their time (default:
    TrafficLimits.for_engine); with an `api_key`, only PROBE_PATHS are open, and not /metrics if `protect_metrics`.
    `auto_tool_parser` (a TOOL_PARSER_REGISTRY name) enables tool_choice "auto" on chat completions.
    `allow_runtime_lora_updating` adds the routes that load and unload adapters. `web_ui`: the chat page at
    `/` and the dashboard at `/dashboard` (open without the key; /stats, with `metrics`, is open as /metrics is)."""
    if isinstance(served_model_name, ServedModels):
        models = served_model_name
    else:
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        models = ServedModels.for_engine(names, engine.config)
    limits = limits or ServerLimits()
    completions = OpenAIServingCompletion(engine, models, chat_template, limits)
    chats = OpenAIServingChat(engine, models, chat_template, limits, auto_tool_parser)
    tokens = OpenAIServingTokens(engine, models, chat_template, limits)

    traffic = traffic or TrafficState(TrafficLimits.for_engine(engine.config.scheduler.max_num_seqs))

    app = FastAPI(title="pagellm", version=__version__)
    install_error_handlers(app)
    # Inside the API key check: an unauthenticated client takes no place in the queue.
    app.add_middleware(TrafficMiddleware, state=traffic)
    if api_key:
        open_paths = PROBE_PATHS | {STATS_PATH} if not protect_metrics else PROBE_PATHS - {"/metrics"}
        if web_ui:
            open_paths |= web_ui_paths()
        app.add_middleware(APIKeyMiddleware, api_key=api_key, open_paths=open_paths)
    # Added last, so outermost: every response (a 401 or 413 too) carries X-Request-Id.
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=limits.max_request_body_bytes)
    app.add_middleware(RequestIdMiddleware)

    async def liveness(request: Request) -> Response:
        """Liveness: 503 once the engine core has died, frozen or stalled (the server then exits)."""
        if not engine.is_running:
            return error_response(APIError("the engine core is not running (it died, froze or stalled)", 503),
                                  request_id_of(request.scope))
        return JSONResponse(HEALTHY)

    app.add_api_route("/health", liveness, methods=["GET"])
    app.add_api_route("/health/live", liveness, methods=["GET"])

    @app.get("/health/ready")
    async def readiness(request: Request) -> Response:
        """Readiness: 503 unless alive, not shutting down and below capacity (a request would be taken)."""
        problem = "the engine core is not running" if not engine.is_running else traffic.not_ready_reason()
        if problem is not None:
            return error_response(APIError(problem, 503), request_id_of(request.scope))
        return JSONResponse(HEALTHY)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    if metrics is not None:
        @app.get("/metrics")
        async def prometheus_metrics() -> Response:
            return Response(metrics.render(), media_type=metrics.content_type)

        add_stats_route(app, engine, list(models.base_names), metrics)
    if web_ui:
        add_web_ui_routes(app)

    def model_card(model: ServedModel) -> ModelCard:
        max_model_len = engine.config.model.max_model_len
        lora = model.lora_request
        if lora is None:
            return ModelCard(id=model.name, root=models.base_names[0], max_model_len=max_model_len)
        return ModelCard(id=model.name, root=lora.lora_path, parent=lora.base_model_name or models.base_names[0],
                         max_model_len=max_model_len)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(model) for model in models])

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> ModelCard:
        return model_card(tokens.check_model(model))

    if allow_runtime_lora_updating:
        # vLLM's routes and answers. Behind the API key like every /v1 path: they read server files.
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
            try:
                await models.load_adapter(request.lora_name, request.lora_path)
            except ValueError as e:
                raise APIError(str(e)) from None
            logger.info("loaded LoRA adapter %s from %s", request.lora_name, request.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            try:
                models.unload_adapter(request.lora_name)
            except UnknownModelError as e:
                raise APIError(str(e), 404, param="lora_name") from None
            logger.info("unloaded LoRA adapter %s", request.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return await chats.create_chat_completion(request, raw_request)

    # OpenAI's Responses API and Anthropic's Messages API, both run as chat requests.
    responses = OpenAIServingResponses(engine, models, chat_template, limits)
    messages = AnthropicServingMessages(engine, models, chat_template, limits)

    @app.post("/v1/responses")
    async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
        return await responses.create_response(request, raw_request)

    @app.post("/v1/messages")
    async def create_message(request: MessagesRequest, raw_request: Request) -> Response:
        return await messages.create_message(request, raw_request)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: CountTokensRequest) -> CountTokensResponse:
        return await messages.count_tokens(request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        return await tokens.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        return tokens.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> TokenizerInfo:
        return tokens.tokenizer_info()

    # Embeddings (pooling runner; a 400 on a generate-runner server).
    embeddings = OpenAIServingEmbedding(engine, models, chat_template, limits)

    @app.post("/v1/embeddings")
    async def create_embedding(request: EmbeddingRequest, raw_request: Request) -> Response:
        return await embeddings.create_embedding(request, raw_request)

    return app


def server_metrics(args: EngineArgs, config: EngineConfig, model_name: str,
                   traffic: TrafficState) -> PrometheusStatLogger:
    """The Prometheus metrics of a server of `config`'s engine, counting what `traffic` admits and turns away."""
    bucket_bound = {"max_model_len": args.max_model_len} if args.max_model_len else {}
    metrics = PrometheusStatLogger(model_name, **bucket_bound, num_engines=args.data_parallel_size,
                                   max_loras=config.lora.max_loras if config.lora is not None else None)
    traffic.on_turned_away = metrics.record_turned_away
    admission = traffic.admission
    metrics.watch_admission(lambda: admission.seqs, lambda: admission.tokens, lambda: admission.num_waiting)
    return metrics


def default_served_name(model: str | None) -> str:
    return model if model is not None else DEFAULT_MODEL_FILE.split(".")[0]


def run_server(ns: argparse.Namespace, start: ServerStart) -> int:
    """Build the app while the engine cores of `start` (`server_start.start_engine`) load the model,
    and serve once they are ready, until SIGINT/SIGTERM (exit status 0) or until an engine core
    dies, freezes or stalls (ENGINE_DEAD_EXIT_CODE); `ns` holds `pagellm serve`'s flags."""
    return _run_event_loop(_serve(ns, start))


def _run_event_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run the server on uvloop where it is installed (not on Windows): a faster loop for the
    thousands of chunks a second that streaming sends; asyncio's own otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def server_startup_phases(engine_phases: dict[str, float], serve_s: float) -> dict[str, float]:
    """The server's start-up phases: the engine's, and the API process's own work as API_SERVER,
    since the process started (`serve_s`, the time since serving began, where that is unknown)."""
    age = startup.process_age_s()
    return startup.with_total(startup.with_remainder(engine_phases, max(serve_s, age or 0.0), startup.API_SERVER))


async def _serve(ns: argparse.Namespace, start: ServerStart) -> int:
    args, config, engine, sock = start.args, start.config, start.engine, start.sock
    try:
        names = ns.served_model_name or [default_served_name(args.model)]
        chat_template, allow_lora_updating, limits = start.chat_template, start.allow_lora_updating, start.limits
        api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
        # Every data-parallel replica runs max_num_seqs sequences. A timeout of 0 is none.
        traffic = TrafficState(TrafficLimits.for_engine(
            args.max_num_seqs * args.data_parallel_size, ns.max_seqs_in_flight, ns.max_waiting_requests,
            ns.max_tokens_in_flight, ns.queue_timeout or None, ns.request_timeout or None))
        models = ServedModels.for_engine(names, config)
        await _load_lora_modules(models, ns.lora_modules or ())  # while the engine loads: a bad one fails fast
        metrics = server_metrics(args, config, names[0], traffic)
        engine.stat_loggers += [metrics, LoggingStatLogger(num_engines=args.data_parallel_size)]
        app = build_app(engine, models, api_key=api_key, chat_template=chat_template, metrics=metrics, limits=limits,
                        traffic=traffic, protect_metrics=ns.protect_metrics,
                        auto_tool_parser=ns.tool_call_parser if ns.enable_auto_tool_choice else None,
                        allow_runtime_lora_updating=allow_lora_updating, web_ui=not ns.disable_web_ui)
        server = _DrainingServer(uvicorn.Config(app, log_level=ns.uvicorn_log_level,
                                                timeout_graceful_shutdown=ns.shutdown_timeout), traffic)
        freeze_startup_objects()  # the app and its libraries live as long as the process
        engine.wait_until_ready()
        host, port = sock.getsockname()[:2]
        served = [model.name for model in models]
        logger.info("serving %s on http://%s:%d%s", ", ".join(served), host, port,
                    " (API key required)" if api_key else "")
        if not ns.disable_web_ui:
            logger.info("chat page: http://%s:%d/  dashboard: http://%s:%d/dashboard", host, port, host, port)
        if allow_lora_updating:
            logger.warning("runtime LoRA updating is on: clients may load adapters from any folder this server "
                           "can read (/v1/load_lora_adapter)")
        watcher = asyncio.create_task(_stop_when_engine_dies(engine, server))
        phases = server_startup_phases(engine.startup_phases, time.perf_counter() - start.started)
        metrics.record_startup(phases)
        logger.info("ready in %s", startup.describe(phases))
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()
        return 0 if engine.is_running else ENGINE_DEAD_EXIT_CODE
    finally:
        # Here, in the event loop: its sockets are the loop's.
        engine.shutdown()


async def _load_lora_modules(models: ServedModels, modules: Sequence[LoRAModule]) -> None:
    """Serve the --lora-modules adapters, each checked against the model; a ValueError names the flag."""
    for module in modules:
        try:
            await models.load_adapter(module.name, module.path, module.base_model_name)
        except ValueError as e:
            raise ValueError(f"--lora-modules: {e}") from None


class _DrainingServer(uvicorn.Server):
    """uvicorn's server, which on SIGINT/SIGTERM also marks the server draining; at its next tick
    (every 0.1 s) uvicorn closes the listening socket (new connections are refused) and the idle
    keep-alive connections, and lets requests in flight finish, for at most --shutdown-timeout
    seconds. Draining answers a request that gets in before that tick with 503 (readiness too)."""

    def __init__(self, config: uvicorn.Config, traffic: TrafficState) -> None:
        super().__init__(config)
        self.traffic = traffic

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.traffic.draining = True
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        # uvicorn cancels the requests still running when --shutdown-timeout passes, without
        # waiting for them: let them end their responses (TrafficMiddleware) and abort their engine
        # requests before the engine stops. Bounded, as a client that stopped reading could block
        # that last write. (After a second signal uvicorn cancels nothing: nothing to wait for.)
        cut = set(self.server_state.tasks)
        if cut and not self.force_exit:
            await asyncio.wait(cut, timeout=CUT_REQUESTS_GRACE_S)


async def _stop_when_engine_dies(engine: AsyncLLM, server: uvicorn.Server) -> None:
    # Requests in flight have already been failed; serving on would only answer 503s. Exiting
    # lets a supervisor restart the whole server.
    reason = await engine.wait_until_dead()
    logger.error("%s; stopping the server (exit status %d) so that a supervisor restarts it", reason,
                 ENGINE_DEAD_EXIT_CODE)
    server.should_exit = True
