"""The web page of `pagellm serve`: a chat playground at `/`, a live dashboard at `/dashboard`, and the
JSON `/stats` route the dashboard polls (off with --disable-web-ui, except /stats).

The pages are static files shipped in the package (`web/`), plain HTML, CSS and JavaScript modules: no
build step, nothing fetched from elsewhere (they work offline).
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.errors import APIError
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.snapshot import metrics_snapshot

WEB_DIR = Path(__file__).parent / "web"
"""The page's files (package data)."""
STATIC_PREFIX = "/ui/"
"""Where the page's scripts and styles are served."""
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
STATS_PATH = "/stats"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
"""Explicit, so that the scripts load as modules whatever the machine's mimetypes database says."""
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation_config.json fields the chat page shows as the server's defaults."""


def web_files() -> dict[str, Path]:
    """The files served under STATIC_PREFIX, by name."""
    return {path.name: path for path in WEB_DIR.iterdir() if path.suffix in MEDIA_TYPES}


def web_ui_paths() -> frozenset[str]:
    """The pages and their files: open without the API key (they hold no data; what they fetch asks for it)."""
    return frozenset(PAGES) | {STATIC_PREFIX + name for name in web_files()}


def engine_summary(engine: AsyncLLM, served_names: list[str]) -> dict[str, Any]:
    """The engine's configuration as the dashboard shows it."""
    config = engine.config
    num_blocks = engine.num_blocks
    generation_config = config.model.source.generation_config
    return {
        "served_model_names": served_names,
        "model": config.model.source.path,
        "architecture": config.model.source.arch.architecture,
        "load_format": config.model.source.load_format,
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "quantization": config.model.quantization,
        "kv_cache_dtype": str(config.cache.kv_cache_dtype).removeprefix("torch."),
        "device": str(config.device),
        "attention_backend": config.model.attention_backend,
        "max_model_len": config.model.max_model_len,
        "block_size": config.cache.block_size,
        "num_kv_blocks": num_blocks,
        "num_kv_tokens": num_blocks * config.cache.block_size,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "scheduling_policy": config.scheduler.policy,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_parallel_size": config.parallel.pipeline_parallel_size,
        "data_parallel_size": config.parallel.data_parallel_size,
        "speculative": config.speculative.method if config.speculative is not None else None,
        "reasoning_parser": config.structured_outputs.reasoning_parser,
        "lora": config.lora is not None,
        "sampling_defaults": {key: generation_config[key] for key in SAMPLING_DEFAULTS if key in generation_config},
    }


def add_stats_route(app: FastAPI, engine: AsyncLLM, served_names: list[str],
                    metrics: PrometheusStatLogger) -> None:
    """`GET /stats`: the engine's configuration and a snapshot of the /metrics counters, as JSON."""
    summary = engine_summary(engine, served_names)

    @app.get(STATS_PATH)
    async def stats() -> JSONResponse:
        return JSONResponse({"engine": summary, **metrics_snapshot(metrics)})


def add_web_ui_routes(app: FastAPI) -> None:
    """The chat page at `/`, the dashboard at `/dashboard`, their files under STATIC_PREFIX."""
    files = web_files()

    def page(name: str) -> Callable[[], Awaitable[FileResponse]]:
        async def serve_page() -> FileResponse:
            return FileResponse(WEB_DIR / name, media_type=MEDIA_TYPES[".html"])
        return serve_page

    for path, name in PAGES.items():
        app.add_api_route(path, page(name), methods=["GET", "HEAD"], include_in_schema=False)

    @app.get(STATIC_PREFIX + "{name}", include_in_schema=False)
    async def static_file(name: str) -> FileResponse:
        path = files.get(name)
        if path is None:
            raise APIError(f"no file {name!r} in the web page", 404)
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix])
