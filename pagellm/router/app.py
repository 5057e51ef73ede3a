"""The router's HTTP front: the OpenAI routes of `pagellm serve`, /health, /metrics and /admin.

A generation request goes: API key -> model's route -> length governance (tokenizer) -> rate
limits -> response cache -> a backend (failover) -> the response, passed through; the key's
counters and the cache are settled when the response ends. In P/D mode (pd.py) the backend step is
a prefill engine, then a decode engine. A client that goes away cancels the backend request.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagellm.entrypoints.openai.errors import CLIENT_CLOSED_REQUEST, APIError, error_response
from pagellm.entrypoints.openai.web_pages import CHAT_PAGE, add_web_ui_routes
from pagellm.router.balance import Backend, ModelRoute, prefix_hashes
from pagellm.router.body import DEFAULT_MAX_TOKENS_ESTIMATE, estimate_tokens, prompt_text, requested_max_tokens
from pagellm.router.cache import BYPASS_HEADER, STATUS_HEADER, CachedResponse
from pagellm.router.client import UPSTREAM_ERRORS
from pagellm.router.config import BackendConfig, KeyConfig
from pagellm.router.length import Governed, LengthError, govern
from pagellm.router.pd import open_disaggregated
from pagellm.router.proxy import open_upstream, respond
from pagellm.router.state import RouterState, RoutingTable

logger = logging.getLogger(__name__)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
TRUNCATED_HEADER = "x-pagellm-truncated"
"""`<tokens before>-><tokens after>` when the prompt was truncated under the model's length policy."""
BACKEND_HEADER = "x-pagellm-backend"
MODELS_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
"""A backend's /v1/models answer, whole."""


def build_app(state: RouterState, reload_on_sighup: bool = False, web_ui: bool = True) -> FastAPI:
    """The app; `reload_on_sighup` (the main thread's loop only) rereads the config on SIGHUP;
    `web_ui`: the chat page at `/` (`pagellm serve`'s; no dashboard: the router has no engine)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        if reload_on_sighup:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _reload_in_background, state)
        yield
        await state.stop()

    app = FastAPI(title="pagellm router", lifespan=lifespan)
    app.state.router = state

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    for path in (*GENERATION_PATHS, "/v1/embeddings"):
        app.add_api_route(path, _proxy_route(state, path), methods=["POST"])
    if web_ui:
        add_web_ui_routes(app, CHAT_PAGE)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authenticate(state.table, request)
        return JSONResponse({"object": "list", "data": await _merged_models(state)})

    @app.get("/health")
    async def health() -> Response:
        table = state.table
        if table.pd is not None:  # a down prefill pool only slows requests (decode prefills them)
            pools = {r.config.name: _in_rotation(r) for r in (table.pd.prefill, table.pd.decode)}
            return JSONResponse({"pools": pools}, status_code=200 if pools["decode"] else 503)
        up = {m.name: _in_rotation(table.routes[m.name]) for m in table.config.models}
        return JSONResponse({"models": up}, status_code=200 if any(up.values()) else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/reload")
    async def reload(request: Request) -> JSONResponse:
        _authenticate_admin(state.table, request)
        try:
            table = await state.reload()
        except ValueError as e:
            raise APIError(f"config not reloaded, the running one is kept: {e}", 400) from e
        return JSONResponse({"models": [m.name for m in table.config.models], "keys": len(table.config.keys)})

    @app.get("/admin/backends")
    async def backends(request: Request) -> JSONResponse:
        _authenticate_admin(state.table, request)
        return JSONResponse([{"url": b.url, "in_flight": b.in_flight, "outstanding_tokens": b.outstanding_tokens,
                              "ejected": b.ejected, "consecutive_failures": b.consecutive_failures}
                             for b in state.table.backends.values()])

    return app


def _in_rotation(route: ModelRoute) -> bool:
    return any(not b.ejected for v in route.versions for b, _ in v.backends)


_background: set[asyncio.Task] = set()
"""Reloads in progress (the loop keeps only weak references to tasks)."""


def _reload_in_background(state: RouterState) -> None:
    async def reload() -> None:
        try:
            await state.reload()
        except ValueError as e:
            logger.error("SIGHUP: config not reloaded, the running one is kept: %s", e)
    task = asyncio.create_task(reload())
    _background.add(task)
    task.add_done_callback(_background.discard)


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else None


def _authenticate(table: RoutingTable, request: Request) -> KeyConfig | None:
    """The request's key; None when the config lists no keys (no auth); 401 otherwise."""
    if not table.keys:
        return None
    secret = _bearer(request)
    key = table.keys.get(secret) if secret is not None else None
    if key is None:
        raise APIError("missing or unknown API key: send `Authorization: Bearer <key>`", 401)
    return key


def _authenticate_admin(table: RoutingTable, request: Request) -> None:
    admin = table.config.admin_key
    secret = _bearer(request)
    if admin is None or secret is None or not secrets.compare_digest(secret.encode(), admin.encode()):
        raise APIError("the admin routes need `Authorization: Bearer <admin_key>` (admin_key in the config)", 401)


def _proxy_route(state: RouterState, path: str):
    async def route(request: Request) -> Response:
        return await _handle(state, state.table, path, request)
    route.__name__ = path.strip("/").replace("/", "_")
    return route


async def _handle(state: RouterState, table: RoutingTable, path: str, request: Request) -> Response:
    key = _authenticate(table, request)
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}", 400) from e
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object", 400)
    model = body.get("model")
    if table.pd is not None:  # every model goes to the pools; an engine answers 404 for one it lacks
        route = table.pd.decode
        model = route.config.name  # the metrics' `model` label: the pool, not what clients send
    else:
        route = table.routes.get(model) if isinstance(model, str) else None
    if route is None:
        raise APIError(f"the model `{model}` does not exist; served: {', '.join(table.routes)}", 404, "model")

    headers: dict[str, str] = {}
    if path in GENERATION_PATHS:
        governed = await _govern(state, table, route, body, key)
        body, input_tokens = governed.body, governed.input_tokens
        if governed.truncated_from is not None:
            headers[TRUNCATED_HEADER] = f"{governed.truncated_from}->{input_tokens}"
    else:
        input_tokens = estimate_tokens(prompt_text(body))

    if key is not None:
        throttle = await table.limiter.admit(key, input_tokens)
        if throttle is not None:
            state.metrics.throttled.labels(key.name, throttle.limit).inc()
            response = error_response(APIError(throttle.message(key), 429))
            response.headers["retry-after"] = str(throttle.retry_after_s)
            return response

    settled = False

    async def settle(output_tokens: int) -> None:
        nonlocal settled
        if settled:
            return
        settled = True
        if key is not None:
            await table.limiter.release(key, output_tokens)

    try:
        stream = body.get("stream") is True
        cache_key = None
        if path in GENERATION_PATHS and request.headers.get(BYPASS_HEADER) is None:
            cache_key = table.cache.key(path, body, key.name if key else None)
        if cache_key is not None:
            hit = await table.cache.get(cache_key)
            state.metrics.cache.labels(model, "hit" if hit else "miss").inc()
            if hit is not None:
                await settle(0)
                return _replay(hit, {**headers, STATUS_HEADER: "hit"})
            headers[STATUS_HEADER] = "miss"

        _, max_tokens = requested_max_tokens(body)
        load = input_tokens + (max_tokens or DEFAULT_MAX_TOKENS_ESTIMATE)
        sticky_header = table.config.sticky_header
        sticky = request.headers.get(sticky_header) if sticky_header else None
        hashes = prefix_hashes(str(body.get("model")), prompt_text(body))

        async def answer() -> Response:
            if table.pd is not None and path in GENERATION_PATHS:
                up = await open_disaggregated(state, table.pd, path, body, dict(request.headers), hashes,
                                              input_tokens, load)
            else:
                up = await open_upstream(state, route, path, body, dict(request.headers), hashes, sticky, load)
            headers[BACKEND_HEADER] = up.backend.url
            media_type = up.response.headers.get("content-type", "")

            async def on_done(output_tokens: int, content: bytes | None) -> None:
                if cache_key is not None and content is not None:
                    await table.cache.put(cache_key, CachedResponse(up.response.status, media_type, content))
                await settle(output_tokens)

            return await respond(state, up, model, stream, load, headers, on_done)

        return await _unless_disconnected(request, answer())
    except BaseException:
        await settle(0)
        raise


async def _unless_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, or a 499 once the client disconnects first: cancelling `work` closes its
    upstream connections, which makes the engines abort the request and free its blocks. (A stream,
    once returned, is cancelled by Starlette when its client goes.)"""
    result = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
        if result in done:
            return result.result()
        raise APIError("the client disconnected before the response was ready", CLIENT_CLOSED_REQUEST)
    finally:
        gone.cancel()
        result.cancel()  # a no-op once done
        await asyncio.gather(result, gone, return_exceptions=True)


async def _until_disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _govern(state: RouterState, table: RoutingTable, route: ModelRoute, body: dict[str, Any],
                  key: KeyConfig | None) -> Governed:
    """The request under its length limits (counted in metrics); APIError 400 when rejected."""
    model = route.config.name
    tokenizer = table.tokenizers.get(model)
    try:
        # Tokenizing a long prompt takes milliseconds the other requests need not wait: on a thread.
        governed = (govern(body, None, route.config, key) if tokenizer is None
                    else await asyncio.to_thread(govern, body, tokenizer, route.config, key))
    except LengthError as e:
        state.metrics.rejections.labels(model).inc()
        raise APIError(str(e), 400, e.param) from e
    if governed.truncated_from is not None:
        state.metrics.truncations.labels(model, route.config.length_policy).inc()
    return governed


def _replay(hit: CachedResponse, headers: dict[str, str]) -> Response:
    if hit.content_type.startswith("text/event-stream"):
        async def chunks() -> AsyncIterator[bytes]:
            yield hit.body
        return StreamingResponse(chunks(), hit.status, headers, media_type=hit.content_type)
    return Response(hit.body, hit.status, headers, media_type=hit.content_type)


async def _merged_models(state: RouterState) -> list[dict[str, Any]]:
    """Each routed model once, with what one of its backends says of it (max_model_len, ...); in P/D
    mode, what the first decode engine that answers serves."""
    table = state.table
    if table.pd is not None:
        for backend, config in table.pd.decode.versions[0].backends:
            listed = None if backend.ejected else await _listed_models(state, backend, config)
            if listed is not None:
                return [m for m in listed if isinstance(m, dict)]
        return []

    async def describe(name: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "pagellm-router"}
        for version in table.routes[name].versions:
            for backend, config in version.backends:
                listed = None if backend.ejected else await _listed_models(state, backend, config)
                if listed is None:  # this backend cannot say: ask the next
                    continue
                match = next((m for m in listed if isinstance(m, dict) and m.get("id") == name), None)
                if match is None and len(listed) == 1 and isinstance(listed[0], dict):
                    match = listed[0]  # a server of one model, named otherwise there
                if match is not None:
                    return {**match, "id": name, "root": match.get("root", match.get("id"))}
        return entry

    return list(await asyncio.gather(*(describe(m.name) for m in table.config.models)))


async def _listed_models(state: RouterState, backend: Backend, config: BackendConfig) -> list[Any] | None:
    """The `data` of the backend's /v1/models, or None when it does not answer one."""
    headers = {"authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with state.http.get(f"{backend.url}/v1/models", headers=headers, timeout=MODELS_TIMEOUT) as response:
            data = await response.json(content_type=None)  # whatever content type it names
        listed = data.get("data") or []
    except (*UPSTREAM_ERRORS, ValueError, AttributeError):
        return None
    return listed if isinstance(listed, list) else None
