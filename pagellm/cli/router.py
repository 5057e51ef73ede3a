"""`pagellm router`: the OpenAI-compatible gateway over many backends (docs/router.md)."""
from __future__ import annotations

import argparse

from pagellm.entrypoints.arg_types import set_handler
from pagellm.router.cli_args import add_router_args


def register(sub: argparse._SubParsersAction) -> None:
    router = sub.add_parser("router", help="OpenAI-compatible gateway over many backends: routing by model, canary "
                            "weights, prefix-affine balancing, rate limits, length limits, a response cache, "
                            "prefill/decode disaggregation",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_router_args(router)
    set_handler(router, _router)


def _router(ns: argparse.Namespace) -> int:
    # Imported here, not at the top: FastAPI, httpx and the tokenizer take a second or more to import,
    # which `pagellm --help` and the other commands need not pay.
    from pagellm.router.server import run_router  # noqa: PLC0415

    return run_router(ns)
