"""The flags of `pagellm serve` (the server's own, its limits and timeouts, and the engine's).

Kept free of FastAPI and pydantic imports so that `pagellm serve --help` stays fast.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pagellm.config.json_flags import json_object
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.liveness import DEFAULT_STALL_TIMEOUT_S
from pagellm.entrypoints.arg_types import non_negative_float, non_negative_int, port, positive_int
from pagellm.entrypoints.openai.limits import DEFAULT_QUEUE_TIMEOUT_S, DEFAULT_REQUEST_TIMEOUT_S, add_limit_args
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSER_REGISTRY

API_KEY_ENV = "PAGELLM_API_KEY"
"""`pagellm serve` reads its API key from here when --api-key is not given."""
RUNTIME_LORA_UPDATING_ENV = "PAGELLM_ALLOW_RUNTIME_LORA_UPDATING"
"""`1` or `true` does what --allow-runtime-lora-updating does (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""


@dataclass(frozen=True, slots=True)
class LoRAModule:
    """One entry of --lora-modules: an adapter served from start-up."""

    name: str
    path: str
    base_model_name: str | None = None


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    """Every flag of `pagellm serve`: the server's, its request limits and timeouts, and the engine's."""
    serve.add_argument("model", nargs="?", default=None, help="model path; default: the embedded SmolLM2-135M-Instruct")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface")
    serve.add_argument("--port", type=port, default=8000, help="TCP port to listen on; 0: any free one")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients pass as `model`; the first is reported in responses and metrics. "
                            "None: the model argument, or SmolLM2-135M-Instruct for the embedded model")
    serve.add_argument("--chat-template", default=None,
                       help="Jinja chat template replacing the model's own: a file path or the template itself")
    serve.add_argument("--api-key", default=None,
                       help=f"require `Authorization: Bearer KEY` on every path but /health, /health/live, "
                            f"/health/ready, /version and /metrics; also read from ${API_KEY_ENV}, which is "
                            f"safer (a command line is visible to every user of the machine)")
    serve.add_argument("--protect-metrics", action="store_true",
                       help="with an API key, require it on /metrics too")
    serve.add_argument("--disable-web-ui", action="store_true",
                       help="do not serve the chat page at / and the dashboard at /dashboard")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="log level of the HTTP server (uvicorn), access log included")
    tools = serve.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let requests use tool_choice "auto" (the default with tools): the model decides, '
                            "and --tool-call-parser reads its calls out of the text")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSER_REGISTRY.names()),
                       help="how the model writes tool calls: " + TOOL_PARSER_REGISTRY.describe(", "))
    _add_lora_args(serve)
    add_limit_args(serve)
    _add_reliability_args(serve)
    EngineArgs.add_cli_args(serve)


def _add_lora_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("LoRA adapters (with --enable-lora)")
    group.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="MODULE",
                       help='adapters served from start-up, each `name=path` or JSON {"name": ..., "path": ..., '
                            '"base_model_name": ...}; requests pass the name as `model`')
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which read any folder "
                            f"the server can read: only for trusted clients; also ${RUNTIME_LORA_UPDATING_ENV}=1")


def lora_module(text: str) -> LoRAModule:
    """--lora-modules' `name=path` or JSON object (argparse type)."""
    if text.lstrip().startswith("{"):
        try:
            entry = json_object(text, "the JSON entry", ("name", "path", "base_model_name"))
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f'expected name=path or a JSON object {{"name": ..., "path": ...}}, '
                                             f"got {text!r}")
        entry = {"name": name, "path": path}
    for key in ("name", "path", "base_model_name"):
        value = entry.get(key)
        if key == "base_model_name" and value is None:
            continue  # optional: the adapter's parent in /v1/models is then the served model
        if not isinstance(value, str) or not value:
            raise argparse.ArgumentTypeError(f"the adapter's {key} must be a non-empty string, in {text!r}")
    return LoRAModule(**entry)


def runtime_lora_updating_allowed(ns: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> bool:
    """--allow-runtime-lora-updating, or $PAGELLM_ALLOW_RUNTIME_LORA_UPDATING set to 1 or true."""
    value = environ.get(RUNTIME_LORA_UPDATING_ENV, "").strip().lower()
    if value not in ("", "0", "false", "1", "true"):
        raise ValueError(f"${RUNTIME_LORA_UPDATING_ENV} must be 1, true, 0 or false, got {value!r}")
    return ns.allow_runtime_lora_updating or value in ("1", "true")


def _add_reliability_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("overload, timeouts and shutdown")
    group.add_argument("--max-seqs-in-flight", type=positive_int, default=None,
                       help="sequences (prompts x n) of generation requests admitted to the engine at once; a "
                            "request that does not fit waits for room. None: 2 per --max-num-seqs")
    group.add_argument("--max-tokens-in-flight", type=positive_int, default=None,
                       help="tokens (prompt + max_tokens of each sequence) admitted to the engine at once; a "
                            "request that does not fit waits for room. None: no bound")
    group.add_argument("--max-waiting-requests", type=non_negative_int, default=None,
                       help="generation requests that may wait for room; past that, a request that does not fit "
                            "gets 503 with Retry-After at once. None: 4 per --max-num-seqs")
    group.add_argument("--queue-timeout", type=non_negative_float, default=DEFAULT_QUEUE_TIMEOUT_S,
                       help="seconds a generation request may wait for room before it gets 503 with Retry-After; "
                            "0: no limit")
    group.add_argument("--request-timeout", type=non_negative_float, default=DEFAULT_REQUEST_TIMEOUT_S,
                       help="seconds after which an unfinished generation request is aborted with a 504 (a stream "
                            "gets an error event); 0: no limit. A client may set a shorter limit for one "
                            "request with the header X-Request-Timeout: <seconds>")
    group.add_argument("--engine-stall-timeout", type=non_negative_float, default=DEFAULT_STALL_TIMEOUT_S,
                       help="seconds one engine step may run before the engine counts as stalled and the server "
                            "exits with status 1 (a dead or frozen engine is noticed within about a second "
                            "regardless); 0: never")
    group.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds that requests in flight may take to finish before the "
                            "server closes them and exits")
