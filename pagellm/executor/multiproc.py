"""One process per rank on this machine, driven over ZMQ.

Each rank runs `Worker` methods in the order the engine sends them: `execute_model` launches a
step without replying, `collect` finishes the oldest one and only the driver replies with its
results. The engine therefore sends step N+1 before it asks for step N's results, and the ranks
overlap the two exactly as a single in-process worker would.

A rank that exits (killed, crashed) or raises is noticed while the engine waits for it or sends
to it, and a step whose results do not come within its timeout (a rank stopped, or stuck in a
kernel or a deadlock) is noticed then: either fails the engine with `WorkerFailedError` and every
rank is stopped. Ranks are fresh interpreters running `pagellm.executor.mp_rank` (never the
caller's `__main__`), and die with the process that started them (Linux parent-death signal), so
a killed engine leaves no orphans.
"""
from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from pagellm.config import EngineConfig
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.base import Executor, StepFuture, WorkerFailedError, hung_step_reason, step_timeout_s

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Longest wait for the ranks to join their process group and load the model."""
_POLL_MS = 50
"""How often a waiting engine looks for dead ranks when no reply has come."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        world_size = config.parallel.world_size
        self._driver_rank = world_size - config.parallel.tensor_parallel_size
        self._tmp = tempfile.TemporaryDirectory(prefix="pagellm-ranks-")
        self._ctx = zmq.Context()
        self._output = self._ctx.socket(zmq.PULL)
        output_address = f"ipc://{os.path.join(self._tmp.name, 'out')}"
        self._output.bind(output_address)
        input_addresses = [f"ipc://{os.path.join(self._tmp.name, f'in{rank}')}" for rank in range(world_size)]
        self._inputs: list[zmq.Socket] = []
        for address in input_addresses:
            self._inputs.append(self._ctx.socket(zmq.PUSH))
            self._inputs[-1].bind(address)
        args_path = os.path.join(self._tmp.name, "args")
        with open(args_path, "wb") as f:
            init_method = f"file://{os.path.join(self._tmp.name, 'rendezvous')}"
            pickle.dump((config, init_method, input_addresses, output_address), f)
        # The ranks import what this process can (a script's sys.path edits, its plugins' paths).
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(os.path.abspath(p) for p in sys.path)}
        # Fresh interpreters, never forked: this process may hold CUDA state or threads.
        self._procs = [
            subprocess.Popen([sys.executable, "-m", "pagellm.executor.mp_rank", args_path, str(rank), str(os.getpid())],
                             stdin=subprocess.DEVNULL, env=env)
            for rank in range(world_size)]
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._inputs, self._output, self._ctx, self._tmp)
        try:
            self._wait(set(range(world_size)), STARTUP_TIMEOUT_S,
                       lambda late: f"ranks {sorted(late)} did not start within {STARTUP_TIMEOUT_S:.0f} s")
            self.collective_rpc("load_model")
            logger.info("%d ranks ready (pids %s)", world_size, " ".join(str(pid) for pid in self.pids))
        except BaseException:
            self.shutdown()
            raise

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, in rank order."""
        return [p.pid for p in self._procs]

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self._send(method, args, "all")
        replies = self._wait(set(range(len(self._procs))))
        return [replies[rank] for rank in range(len(self._procs))]

    def execute_model(self, so: SchedulerOutput) -> StepFuture:
        self._send("execute_model", (so,), "none")
        return StepFuture(lambda: self._collect(so.total_num_scheduled_tokens))

    def _collect(self, num_tokens: int) -> ModelRunnerOutput:
        self._send("collect", (), "driver")
        # The deadline counts from this wait, not the launch: a pipeline's later steps queue behind earlier ones.
        parallel = self.config.parallel
        return self._wait({self._driver_rank}, step_timeout_s(parallel, num_tokens),
                          lambda _: hung_step_reason(parallel, num_tokens, self.pids))[self._driver_rank]

    def check_health(self) -> None:
        dead = self._dead_rank()
        if dead:
            self._fail(dead)

    def _send(self, method: str, args: tuple, reply: str) -> None:
        message = pickle.dumps((method, args, reply), protocol=pickle.HIGHEST_PROTOCOL)
        for sock in self._inputs:
            while True:
                try:
                    sock.send(message, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    # No pipe to the rank (it died: a blocking send would wait forever, while the
                    # core's heartbeats say it is fine) or its queue is full: wait, watching the ranks.
                    dead = self._dead_rank()
                    if dead:
                        self._fail(dead)
                    sock.poll(_POLL_MS, zmq.POLLOUT)

    def _wait(self, ranks: set[int], timeout_s: float | None = None,
              late: Callable[[set[int]], str] | None = None) -> dict[int, Any]:
        """Replies of `ranks` (one each); raises WorkerFailedError, stopping every rank, when one of
        them dies or raises first, or after `timeout_s` (with `late(the ranks that did not reply)`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        replies: dict[int, Any] = {}
        while ranks - replies.keys():
            if self._output.poll(_POLL_MS):
                kind, rank, payload = pickle.loads(self._output.recv())
                if kind == "error":
                    # A rank that lost a peer fails in its collective: name the dead peer first.
                    dead = self._dead_rank(wait_s=1.0, besides=rank)
                    self._fail(f"{dead + '; then ' if dead else ''}rank {rank} failed: {payload}")
                replies[rank] = payload
                continue
            dead = self._dead_rank()
            if dead:
                self._fail(dead)
            if deadline is not None and time.monotonic() > deadline:
                self._fail(late(ranks - replies.keys()))
        return replies

    def _dead_rank(self, wait_s: float = 0.0, besides: int | None = None) -> str | None:
        """'rank R (pid P) exited with code C' for the first rank but `besides` found dead within
        `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._procs):
                if rank != besides and proc.poll() is not None:
                    return f"rank {rank} (pid {proc.pid}) exited with code {proc.returncode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def _fail(self, reason: str) -> None:
        logger.error("distributed executor: %s; stopping every rank", reason)
        for proc in self._procs:  # the others are likely blocked in a collective with the failed one
            if proc.poll() is None:
                proc.kill()
        self.shutdown()
        raise WorkerFailedError(reason)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs: list[subprocess.Popen], inputs: list[zmq.Socket], output: zmq.Socket, ctx: zmq.Context,
          tmp: tempfile.TemporaryDirectory) -> None:
    """Ask the ranks to exit, kill those that do not within seconds, and release the sockets."""
    message = pickle.dumps(("shutdown", (), "none"))
    for sock, proc in zip(inputs, procs):
        if proc.poll() is None:
            try:
                sock.send(message, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # stuck in a collective with a dead peer, or frozen
            proc.kill()
            proc.wait(timeout=5.0)
    for sock in (*inputs, output):
        sock.close(linger=0)
    ctx.term()
    tmp.cleanup()
