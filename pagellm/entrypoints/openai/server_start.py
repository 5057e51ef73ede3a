"""The first steps of `pagellm serve`, taken before the HTTP stack is imported: the port bound, the
server's flags checked, the engine's configuration resolved and its engine-core processes spawned.
The cores then import and load the model while the API process imports FastAPI and builds its app
(`api_server.run_server`), rather than after it. Nothing here imports FastAPI or pydantic.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pagellm.config.engine import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.cli_args import runtime_lora_updating_allowed
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.plugins import load_plugins
from pagellm.tokenizer.chat_template import compile_chat_template


@dataclass
class ServerStart:
    """What `start_engine` hands the server: its bound socket, its engine (cores spawned, perhaps
    not ready yet: `AsyncLLM.wait_until_ready`), and when the start began."""

    sock: socket.socket
    args: EngineArgs
    config: EngineConfig
    engine: AsyncLLM
    started: float
    """time.perf_counter() when the start began."""
    chat_template: str | None
    """--chat-template's template, read and compiled."""
    allow_lora_updating: bool
    limits: ServerLimits


@contextlib.contextmanager
def start_engine(ns: argparse.Namespace) -> Iterator[ServerStart]:
    """Bind `ns`'s port, resolve the engine's configuration and spawn its cores; on leaving the
    block, stop them and close the socket. SIGINT and SIGTERM exit through SystemExit from here on,
    so that the block's exit stops the cores also when a signal comes during start-up."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    load_plugins()  # the API process's registries (the CLI has loaded them; this may be called alone)
    started = time.perf_counter()
    # Bind before the model loads, so a busy port fails in a moment rather than after start-up.
    sock = bind(ns.host, ns.port)
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _exit_cleanly)
        args = EngineArgs.from_cli_args(ns)
        # The server's own flags first: their errors need no model.
        chat_template = load_chat_template(ns.chat_template)
        if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser, to read the model's tool calls")
        if ns.lora_modules and not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora, which makes the engine able to run adapters")
        allow_lora_updating = runtime_lora_updating_allowed(ns)
        limits = ServerLimits.from_namespace(ns)
        config = args.create_engine_config()
        engine = AsyncLLM(config, stall_timeout_s=ns.engine_stall_timeout or None, wait=False)
        try:
            yield ServerStart(sock=sock, args=args, config=config, engine=engine, started=started,
                              chat_template=chat_template, allow_lora_updating=allow_lora_updating, limits=limits)
        finally:
            engine.shutdown()
    finally:
        sock.close()


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file's content, or the value itself when it is an inline template."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{" in value:
        template = value
    else:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template string")
    try:
        compile_chat_template(template)  # a syntax error should stop start-up, not fail every request
    except ValueError as e:
        raise ValueError(f"--chat-template: {e}") from None
    return template


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port` (not listening yet); a ValueError naming the flags if taken."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}); choose another --port or --host") from None
    return sock


def _exit_cleanly(signum: int, frame: object) -> None:
    # uvicorn re-raises the signal that stopped it once it has shut down. Exiting through
    # SystemExit, rather than dying from the signal, runs the `finally` that stops the engine
    # process (also when the signal comes during start-up).
    raise SystemExit(0)
