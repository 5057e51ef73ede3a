"""`pagellm serve`: the OpenAI-compatible HTTP server."""
from __future__ import annotations

import argparse
import sys

from pagellm.entrypoints.arg_types import set_handler
from pagellm.entrypoints.openai.cli_args import add_serve_args
from pagellm.entrypoints.openai.server_start import start_engine


def register(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve)
    set_handler(serve, _serve)


def _serve(ns: argparse.Namespace) -> int:
    try:
        with start_engine(ns) as start:
            # Imported here, not at the top: FastAPI and the protocol models take a second to import,
            # which `pagellm --help` and the other commands need not pay; and only now, so that the
            # engine cores spawned by start_engine import and load the model meanwhile.
            from pagellm.entrypoints.openai.api_server import run_server  # noqa: PLC0415

            return run_server(ns, start)
    except RuntimeError as e:  # the engine process failed to start
        print(f"{ns.prog}: error: {e}", file=sys.stderr)
        return 1
