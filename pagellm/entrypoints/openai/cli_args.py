"""The flags of `pagellm serve` (the server's own, its limits and timeouts, and the engine's).

Kept free of FastAPI and pydantic imports so that `pagellm serve --help` stays fast.
"""
from __future__ import annotations

import argparse

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.liveness import DEFAULT_STALL_TIMEOUT_S
from pagellm.entrypoints.arg_types import non_negative_float, non_negative_int, port, positive_float
from pagellm.entrypoints.openai.limits import add_limit_args
from pagellm.entrypoints.openai.tool_parsers import TOOL_PARSER_REGISTRY

API_KEY_ENV = "PAGELLM_API_KEY"
"""`pagellm serve` reads its API key from here when --api-key is not given."""


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
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="log level of the HTTP server (uvicorn), access log included")
    tools = serve.add_argument_group("tool calling")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let requests use tool_choice "auto" (the default with tools): the model decides, '
                            "and --tool-call-parser reads its calls out of the text")
    tools.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSER_REGISTRY.names()),
                       help="how the model writes tool calls: " + TOOL_PARSER_REGISTRY.describe(", "))
    add_limit_args(serve)
    _add_reliability_args(serve)
    EngineArgs.add_cli_args(serve)


def _add_reliability_args(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("overload, timeouts and shutdown")
    group.add_argument("--max-waiting-requests", type=non_negative_int, default=None,
                       help="generation requests that may wait beyond the --max-num-seqs the engine runs; past "
                            "that, new ones get 503 with Retry-After at once. None: 4 per --max-num-seqs")
    group.add_argument("--request-timeout", type=positive_float, default=None,
                       help="seconds after which an unfinished generation request is aborted with a 504 (a stream "
                            "gets an error event); None: no limit. A client may set a shorter limit for one "
                            "request with the header X-Request-Timeout: <seconds>")
    group.add_argument("--engine-stall-timeout", type=non_negative_float, default=DEFAULT_STALL_TIMEOUT_S,
                       help="seconds one engine step may run before the engine counts as stalled and the server "
                            "exits with status 1 (a dead or frozen engine is noticed within about a second "
                            "regardless); 0: never")
    group.add_argument("--shutdown-timeout", type=non_negative_float, default=30.0,
                       help="on SIGTERM/SIGINT, seconds that requests in flight may take to finish before the "
                            "server closes them and exits")
