"""A `pagellm serve` child process on a free loopback port, for the sweep that varies server settings."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import TracebackType

import httpx

_POLL_S = 0.5
_STOP_TIMEOUT_S = 60.0


class ServerProcess:
    """`pagellm serve [model] *args` on 127.0.0.1 while the `with` block runs; output goes to a log
    file whose tail a failure quotes."""

    def __init__(self, model: str | None, args: list[str], startup_timeout_s: float = 300.0,
                 poll_s: float = _POLL_S, launcher: list[str] | None = None) -> None:
        """`poll_s`: how often /health/ready is asked while the server starts. `launcher`: another
        server's command (it takes --host and --port and answers /health/ready), in place of
        `pagellm serve [model]`."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        launcher = launcher or [sys.executable, "-m", "pagellm.cli", "serve", *([model] if model else [])]
        self.command = [*launcher, "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._name = " ".join(launcher[2:4])  # `pagellm.cli serve`, or the module of another launcher
        self._startup_timeout_s = startup_timeout_s
        self._poll_s = poll_s
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-sweep-", suffix=".log")
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self._process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop()

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        with open(self._log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-num_chars:]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    raise ValueError(f"{self._name} exited with code {self._process.returncode} "
                                     f"({' '.join(self.command)}):\n{self.log_tail()}")
                try:
                    if client.get(f"{self.url}/health/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(self._poll_s)
        raise ValueError(f"{self._name} was not ready within {self._startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def _stop(self) -> None:
        """SIGTERM (a graceful drain), then SIGKILL after a deadline."""
        if self._process is not None and self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._log.close()
