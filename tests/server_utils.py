"""Run a real `pagellm serve` process for tests: a free port, a bounded wait on /health, a clean stop."""
from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`pagellm serve MODEL *args` on 127.0.0.1 until `stop()`; its output goes to a log file that
    failures quote. `model` None serves the embedded model; `program` runs another command than this
    interpreter's `-m pagellm.cli` (the installed console script, as a reader would)."""

    def __init__(self, model: str | None, *args: str, env: dict[str, str] | None = None,
                 program: list[str] | None = None, cwd: str | None = None,
                 startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-serve-", suffix=".log", delete=False)
        command = [*(program or [sys.executable, "-m", "pagellm.cli"]), "serve", *([model] if model else []),
                   "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
                                        env={**os.environ, **(env or {})})
        self._startup_timeout_s = startup_timeout_s
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        # One client for the whole wait: httpx.get would build an SSL context per poll (~20 ms of CPU
        # taken from the model load).
        with httpx.Client(timeout=1.0) as http:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"server exited with code {self.process.returncode}:\n{self.log_tail()}")
                try:
                    if http.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"server not healthy within {self._startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def engine_pid(self) -> int:
        """The engine-core process's pid, from the server's start-up log line."""
        match = re.search(r"engine core ready \(pid (\d+)\)", self.log_tail(1_000_000))
        if match is None:
            raise AssertionError(f"no engine pid in the server log:\n{self.log_tail()}")
        return int(match.group(1))

    def log_tail(self, num_chars: int = 4000) -> str:
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-num_chars:]

    def stop(self) -> int:
        """SIGTERM (graceful: the engine process is shut down too), SIGKILL after a deadline."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        os.unlink(self._log.name)
        return self.process.returncode


def metric_samples(url: str, headers: dict[str, str] | None = None) -> dict[str, float]:
    """`name{finished_reason}` or `name{reason}` (or `name`) -> value for every sample on the server's
    /metrics, parsed by prometheus_client; `headers` may carry the API key (`--protect-metrics`)."""
    # urllib, not httpx.get: httpx builds an SSL context per call (~20 ms of CPU), too dear for a poll
    # loop on a 2-core machine that is also running the server.
    with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=headers or {}),
                                timeout=10.0) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason") or sample.labels.get("reason")
            samples[f"{sample.name}{{{reason}}}" if reason else sample.name] = sample.value
    return samples


def is_idle(samples: dict[str, float]) -> bool:
    """Nothing running or waiting and no KV block held (cached-but-free blocks count as free)."""
    return (samples["pagellm:num_requests_running"] == 0 and samples["pagellm:num_requests_waiting"] == 0
            and samples["pagellm:kv_cache_usage_perc"] == 0)


@contextlib.contextmanager
def health_latencies(url: str) -> Iterator[list[float]]:
    """/health polled from a thread of its own while the block runs: the latency of each answer (inf for
    an answer other than 200)."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=30) as http:
            while not stop.is_set():
                start = time.monotonic()
                ok = http.get("/health").status_code == 200
                latencies.append(time.monotonic() - start if ok else math.inf)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join()
