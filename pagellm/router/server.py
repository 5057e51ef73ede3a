"""`pagellm router`'s process: the config, the app, uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal

import uvicorn

from pagellm.router.app import build_app
from pagellm.router.state import RouterState


def make_state(ns: argparse.Namespace) -> RouterState:
    """The router's state from the flags; ValueError naming the config key or flag."""
    overrides = {"cache_url": ns.cache_url, "admin_key": ns.admin_key, "sticky_header": ns.sticky_header,
                 "prefill": ns.prefill, "decode": ns.decode}
    return RouterState(ns.config, overrides, ns.backend)


def run_router(ns: argparse.Namespace) -> int:
    state = make_state(ns)
    # Fail at start-up, naming cache.url, when Redis does not answer (uvicorn would only log it).
    asyncio.run(_check_store(state))
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(state, reload_on_sighup=True, web_ui=not ns.disable_web_ui)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level, timeout_graceful_shutdown=30)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    uvicorn.Server(config).run()
    return 0


def _exit_cleanly(signum: int, frame: object) -> None:
    # uvicorn re-raises the signal that stopped it once it has drained; exit 0, not "killed by SIGTERM".
    raise SystemExit(0)


async def _check_store(state: RouterState) -> None:
    try:
        await state.check_store()
    finally:
        await state.table.store.close()  # its connections belong to this short-lived loop
