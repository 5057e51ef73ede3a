"""Fake OpenAI-compatible backends and an in-process `pagellm router`, each a uvicorn server on an
ephemeral port in a thread of this process, for the router's tests."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagellm.router.app import build_app
from pagellm.router.state import RouterState

STARTUP_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], Any], timeout_s: float) -> None:
    """Poll `condition` until it is truthy, failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s")
        time.sleep(0.05)


class ThreadServer:
    """A uvicorn server for `app` on 127.0.0.1 in a daemon thread, until `stop()`."""

    def __init__(self, app: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:  # uvicorn sets it once the socket listens
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


@dataclass
class FakeBackend:
    """An OpenAI-compatible server that answers with its own name and records what it received.

    Completions answer `text` = "<name>:<n>" (n counts its requests) with `usage.completion_tokens`
    = `output_tokens`; a stream sends `stream_events` chunks (and the usage, when the request asks
    with `include_usage`) then [DONE]. Knobs: `status` (answer every request with it), `healthy`
    (/health), `break_after` (drop the connection after that many stream events), `gate` (hold
    requests until set), `hold` (hold each request until its client goes, counted in `disconnects`;
    a stream sends its first event first), `kv_params` (the top-level `kv_transfer_params` a P/D
    prefill request, one with `do_remote_decode`, is answered with), `break_after` also cuts a
    non-streamed body short when 0, `gzip` (answer gzip-encoded, a stream flushed event by event)."""

    name: str
    output_tokens: int = 5
    stream_events: int = 3
    status: int = 200
    healthy: bool = True
    break_after: int | None = None
    gate: threading.Event | None = None
    hold: bool = False
    kv_params: dict[str, Any] | None = None
    gzip: bool = False
    disconnects: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    server: ThreadServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.url

    def start(self) -> FakeBackend:
        self.server = ThreadServer(self._app())
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200 if self.healthy else 503)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model", "created": 1,
                                                             "owned_by": "fake", "max_model_len": 77}]})

        async def generate(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            self.paths.append(request.url.path)
            self.headers.append(dict(request.headers))
            if self.gate is not None:
                await asyncio.to_thread(self.gate.wait, 10)
            if self.status != 200:
                return JSONResponse({"error": {"message": "fake failure", "type": "x", "param": None,
                                               "code": self.status}}, status_code=self.status)
            n = len(self.bodies)
            if body.get("stream"):
                usage = (body.get("stream_options") or {}).get("include_usage", False)
                events = self._events(n, usage)
                if self.gzip:
                    return StreamingResponse(_gzipped(events), media_type="text/event-stream",
                                             headers={"content-encoding": "gzip"})
                return StreamingResponse(events, media_type="text/event-stream")
            if self.hold:
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                self.disconnects += 1
                return Response(status_code=499)
            if self.break_after == 0:
                return StreamingResponse(self._cut_short(), media_type="application/json")
            answer = {"id": f"cmpl-{n}", "object": "text_completion", "model": body.get("model"),
                      "choices": [{"index": 0, "text": f"{self.name}:{n}", "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": f"{self.name}:{n}"}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": self.output_tokens,
                                "total_tokens": 1 + self.output_tokens}}
            if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                answer["kv_transfer_params"] = self.kv_params
            if self.gzip:
                compressor = zlib.compressobj(wbits=GZIP_WBITS)
                return Response(compressor.compress(json.dumps(answer).encode()) + compressor.flush(),
                                media_type="application/json", headers={"content-encoding": "gzip"})
            return JSONResponse(answer)

        for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings"):
            app.add_api_route(path, generate, methods=["POST"])
        return app

    async def _cut_short(self) -> AsyncIterator[bytes]:
        yield b'{"id": "cmpl-'
        raise RuntimeError("fake backend dies mid-response")

    async def _events(self, n: int, usage: bool) -> AsyncIterator[bytes]:
        for i in range(self.stream_events):
            if self.hold and i == 1:
                try:
                    await asyncio.Event().wait()  # until Starlette cancels the stream: its client went
                finally:
                    self.disconnects += 1
            if self.break_after is not None and i == self.break_after:
                raise RuntimeError("fake backend dies mid-stream")
            chunk = {"id": f"cmpl-{n}", "object": "chat.completion.chunk", "model": "m",
                     "choices": [{"index": 0, "delta": {"content": f"{self.name}:{n}:{i} "}, "text": f"{i} ",
                                  "finish_reason": None}]}
            yield f"data: {json.dumps(chunk)}\n\n".encode()
        if usage:
            last = {"id": f"cmpl-{n}", "object": "chat.completion.chunk", "model": "m", "choices": [],
                    "usage": {"prompt_tokens": 1, "completion_tokens": self.output_tokens,
                              "total_tokens": 1 + self.output_tokens}}
            yield f"data: {json.dumps(last)}\n\n".encode()
        yield b"data: [DONE]\n\n"


GZIP_WBITS = 31
"""zlib's gzip framing."""


async def _gzipped(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """One gzip stream, flushed after each chunk so that each arrives when it is sent."""
    compressor = zlib.compressobj(wbits=GZIP_WBITS)
    async for chunk in chunks:
        yield compressor.compress(chunk) + compressor.flush(zlib.Z_SYNC_FLUSH)
    yield compressor.flush()


class RouterUnderTest:
    """A router from a config dict (written to `path`, so reload tests can change it), served in-process."""

    def __init__(self, config: dict[str, Any], path: str, web_ui: bool = True) -> None:
        self.path = path
        self.write(config)
        self.state = RouterState(path, {}, [])
        self.server = ThreadServer(build_app(self.state, web_ui=web_ui))
        self.url = self.server.url

    def write(self, config: dict[str, Any]) -> None:
        with open(self.path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)

    def call(self, coro: Any) -> Any:
        """Run a coroutine on the router's event loop (its state belongs to that loop)."""
        loop = self.state._health_task.get_loop()  # the loop the app's lifespan started it on
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)

    def stop(self) -> None:
        self.server.stop()


class RouterProcess:
    """`pagellm router --config PATH` in a subprocess on an ephemeral port (ready once /health
    answers 200) until `stop()`; its output goes to a log file that failures quote."""

    def __init__(self, config_path: str, timeout_s: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-router-", suffix=".log")
        self.process = subprocess.Popen([sys.executable, "-m", "pagellm.cli", "router", "--config", config_path,
                                         "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
                                        stdout=self._log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._ready, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"router exited with code {self.process.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, num_chars: int = 4000) -> str:
        self._log.seek(0)
        return self._log.read()[-num_chars:]

    def stop(self) -> int:
        """SIGTERM; the exit status (0 when it drained and exited cleanly)."""
        if self.process.poll() is None:
            self.process.terminate()
        code = self.process.wait(timeout=30)
        self._log.close()
        return code


QUIET = {"health_interval_s": 3600}
"""Only the start-up probe runs: tests drive further probes themselves."""


@pytest.fixture
def fakes():
    """`fakes(name, **knobs)` starts a FakeBackend, stopped after the test."""
    started: list[FakeBackend] = []

    def start(name: str, **kwargs: Any) -> FakeBackend:
        started.append(FakeBackend(name, **kwargs).start())
        return started[-1]

    yield start
    for f in started:
        f.stop()


@pytest.fixture
def router(tmp_path):
    """`router(config)` starts a RouterUnderTest on that config, stopped after the test."""
    started: list[RouterUnderTest] = []

    def start(config: dict[str, Any]) -> RouterUnderTest:
        started.append(RouterUnderTest({**QUIET, **config}, str(tmp_path / f"router{len(started)}.yaml")))
        return started[-1]

    yield start
    for r in started:
        r.stop()


@pytest.fixture
def redis_url():
    """A fresh `redis-server` (Debian's binary) on an ephemeral port, without persistence; skipped,
    saying so, where the binary is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed on this machine (Debian: apt-get install redis-server)")
    port = free_port()
    process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(b"PING\r\n")
                if conn.recv(64).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"redis-server did not start on port {port}")
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(timeout=10)
