"""The engine core's grammar compile threads, and what becomes of a compile past its time limit.

xgrammar cannot interrupt a compile. One that runs past its limit is written off: its request is
refused, a fresh thread takes its place so that later compiles do not queue behind it, and the
written-off thread ends when the compile does. At most `max_written_off` threads are written off
at once; a further compile past its limit keeps its thread, and the pool runs one thread short
until it ends.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class _Worker:
    written_off: bool = False


class CompilePool:
    def __init__(self, threads: int, max_written_off: int, name: str) -> None:
        self._threads = threads
        self._max_written_off = max_written_off
        self._name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        """(future, fn, args) to run; None tells a thread to end."""
        self._lock = threading.Lock()
        """Guards `_running` and `_written_off`."""
        self._running: dict[concurrent.futures.Future, _Worker] = {}
        self._written_off = 0
        for _ in range(threads):
            self._start_thread()

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.put((future, fn, args))
        return future

    def write_off(self, future: concurrent.futures.Future) -> bool:
        """`future`'s compile ran past its time limit: True if a fresh thread took the place of the
        one running it; False if it is not running, or `max_written_off` threads already are."""
        with self._lock:
            worker = self._running.get(future)
            if worker is None or worker.written_off or self._written_off >= self._max_written_off:
                return False
            worker.written_off = True
            self._written_off += 1
        self._start_thread()
        return True

    @property
    def written_off(self) -> int:
        """Threads still running a compile that was written off."""
        with self._lock:
            return self._written_off

    def shutdown(self) -> None:
        """Cancel the compiles not started and end the idle threads (a running compile finishes:
        the threads are daemons, so the process does not wait for them)."""
        while True:
            try:
                task = self._tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task[0].cancel()
        for _ in range(self._threads):
            self._tasks.put(None)

    def _start_thread(self) -> None:
        worker = _Worker()
        threading.Thread(target=self._work, args=(worker,), name=self._name, daemon=True).start()

    def _work(self, worker: _Worker) -> None:
        while (task := self._tasks.get()) is not None:
            future, fn, args = task
            if not future.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[future] = worker
            try:
                result = fn(*args)
            except BaseException as e:  # the future carries it to whoever waits
                future.set_exception(e)
            else:
                future.set_result(result)
            with self._lock:
                del self._running[future]
                if worker.written_off:  # a fresh thread took its place
                    self._written_off -= 1
                    return
