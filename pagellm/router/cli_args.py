"""`pagellm router`'s flags (argparse only: `pagellm --help` does not import the router)."""
from __future__ import annotations

import argparse

from pagellm.entrypoints.arg_types import port


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="YAML file: models (backends, limits), keys, cache; "
                        "reread on SIGHUP or POST /admin/reload. See docs/router.md")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for every interface")
    parser.add_argument("--port", type=port, default=8080)
    parser.add_argument("--backend", action="append", default=[], metavar="NAME=URL[@WEIGHT]",
                        help="Serve model NAME from the backend at URL (repeatable; adds to the config's models)")
    parser.add_argument("--prefill", nargs="+", default=None, metavar="URL",
                        help="Disaggregated prefill/decode: the prefill engines (kv_producer), with --decode; "
                        "overrides prefill (docs/router.md)")
    parser.add_argument("--decode", nargs="+", default=None, metavar="URL",
                        help="The decode engines (kv_consumer) that pull the prompt's KV from a prefill engine; "
                        "overrides decode")
    parser.add_argument("--cache-url", default=None, help="memory:// or redis://host:port/db (overrides cache.url; "
                        "Redis also holds the rate-limit counters)")
    parser.add_argument("--admin-key", default=None, help="Bearer key of the /admin routes (overrides admin_key)")
    parser.add_argument("--sticky-header", default=None,
                        help="Request header whose value pins a client to one canary version (overrides sticky_header)")
    parser.add_argument("--disable-web-ui", action="store_true",
                        help="Do not serve the chat page at / (docs/web-ui.md)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
