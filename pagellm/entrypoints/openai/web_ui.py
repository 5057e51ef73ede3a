"""The engine's side of the web page (`pagellm.entrypoints.openai.web_pages`): the JSON `/stats` route
the dashboard polls, with the engine's configuration (served even with --disable-web-ui).
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pagellm.engine.async_llm import AsyncLLM
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.snapshot import metrics_snapshot

STATS_PATH = "/stats"
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The generation_config.json fields the chat page shows as the server's defaults."""


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
