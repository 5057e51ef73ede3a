"""One process per rank on this machine, driven over ZMQ.

Each rank runs `Worker` methods in the order the engine sends them: `execute_model` launches a
step without replying, `collect` finishes the oldest one and only the driver replies with its
results. The engine therefore sends step N+1 before it asks for step N's results, and the ranks
overlap the two exactly as a single in-process worker would.

A rank that exits (killed, crashed) or raises is noticed while the engine waits for it or sends
to it, and fails the engine with `WorkerFailedError`; every rank is then stopped. Ranks die with
the process that started them (Linux parent-death signal), so a killed engine leaves no orphans.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import weakref
from typing import Any

import zmq

from pagellm.config import EngineConfig
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.executor.base import Executor, StepFuture, WorkerFailedError
from pagellm.worker.worker import Worker

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
"""Longest wait for the ranks to join their process group and load the model."""
_POLL_MS = 50
"""How often a waiting engine looks for dead ranks when no reply has come."""


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux)."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


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
        self._inputs: list[zmq.Socket] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        # multiprocessing forbids daemonic processes (the server's engine core) to start children,
        # lest they be orphaned; ranks die with their parent (die_with_parent) and are stopped by it.
        current = multiprocessing.current_process()
        if current.daemon:
            current.daemon = False
        spawn = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        init_method = f"file://{os.path.join(self._tmp.name, 'rendezvous')}"
        for rank in range(world_size):
            sock = self._ctx.socket(zmq.PUSH)
            address = f"ipc://{os.path.join(self._tmp.name, f'in{rank}')}"
            sock.bind(address)
            self._inputs.append(sock)
            proc = spawn.Process(target=_worker_main, name=f"pagellm-rank-{rank}", daemon=True,
                                 args=(config, rank, init_method, address, output_address))
            proc.start()
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._inputs, self._output, self._ctx, self._tmp)
        try:
            self._wait(set(range(world_size)), time.monotonic() + STARTUP_TIMEOUT_S)
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
        return StepFuture(self._collect)

    def _collect(self) -> ModelRunnerOutput:
        self._send("collect", (), "driver")
        return self._wait({self._driver_rank})[self._driver_rank]

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

    def _wait(self, ranks: set[int], deadline: float | None = None) -> dict[int, Any]:
        """Replies of `ranks` (one each); raises WorkerFailedError, stopping every rank, when one of
        them dies or raises first, or at the deadline."""
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
                self._fail(f"ranks {sorted(ranks - replies.keys())} did not answer in time")
        return replies

    def _dead_rank(self, wait_s: float = 0.0, besides: int | None = None) -> str | None:
        """'rank R (pid P) exited with code C' for the first rank but `besides` found dead within
        `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self._procs):
                if rank != besides and proc.exitcode is not None:
                    return f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def _fail(self, reason: str) -> None:
        logger.error("distributed executor: %s; stopping every rank", reason)
        for proc in self._procs:  # the others are likely blocked in a collective with the failed one
            if proc.is_alive():
                proc.kill()
        self.shutdown()
        raise WorkerFailedError(reason)

    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs: list, inputs: list[zmq.Socket], output: zmq.Socket, ctx: zmq.Context,
          tmp: tempfile.TemporaryDirectory) -> None:
    """Ask the ranks to exit, kill those that do not within seconds, and release the sockets."""
    message = pickle.dumps(("shutdown", (), "none"))
    for sock, proc in zip(inputs, procs):
        if proc.is_alive():
            try:
                sock.send(message, flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    deadline = time.monotonic() + 5.0
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():  # stuck in a collective with a dead peer, or frozen
            proc.kill()
            proc.join(timeout=5.0)
    for sock in (*inputs, output):
        sock.close(linger=0)
    ctx.term()
    tmp.cleanup()


def _worker_main(config: EngineConfig, rank: int, init_method: str, input_address: str,
                 output_address: str) -> None:
    """A rank's process: build the worker, then run the methods the engine sends, in order."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine's owner handles Ctrl-C and stops us
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = ctx.socket(zmq.PUSH)
    outputs.connect(output_address)
    worker = None
    try:
        worker = Worker(config, rank, init_method)
        outputs.send(pickle.dumps(("ready", rank, None)))
        while True:
            method, args, reply = pickle.loads(inputs.recv())
            if method == "shutdown":
                return
            result = getattr(worker, method)(*args)
            if reply == "all" or (reply == "driver" and worker.is_driver):
                outputs.send(pickle.dumps(("result", rank, result), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as e:
        logger.error("rank %d failed:\n%s", rank, traceback.format_exc())
        outputs.send(pickle.dumps(("error", rank, f"{type(e).__name__}: {e}")))
        sys.exit(1)
    finally:
        if worker is not None:
            worker.shutdown()
        outputs.close(linger=1000)
        inputs.close(linger=0)
        ctx.term()
