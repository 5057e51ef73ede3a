"""A rank's process under the `mp` executor: `python -m pagellm.executor.mp_rank ARGS_FILE RANK PARENT_PID`.

A fresh interpreter running this module, never the caller's `__main__`: multiprocessing's spawn
re-runs the parent's main script in every child, so a script that builds `LLM(...)` at its top
level without an `if __name__ == "__main__":` guard would start the engine again in each rank.
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback

import zmq

from pagellm.config import EngineConfig
from pagellm.worker.worker import Worker

logger = logging.getLogger("pagellm.executor.mp_rank")  # also when run as __main__


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux), and exit
    now if that happened before this call."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # orphaned while the interpreter started: no one will stop us
        sys.exit(1)


def run_rank(config: EngineConfig, rank: int, init_method: str, input_address: str, output_address: str) -> None:
    """Build the worker, then run the methods the engine sends, in order (see `multiproc`)."""
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


def main(argv: list[str]) -> None:
    args_path, rank, parent_pid = argv[0], int(argv[1]), int(argv[2])
    die_with_parent(parent_pid)
    with open(args_path, "rb") as f:
        config, init_method, input_addresses, output_address = pickle.load(f)
    run_rank(config, rank, init_method, input_addresses[rank], output_address)


if __name__ == "__main__":
    main(sys.argv[1:])
