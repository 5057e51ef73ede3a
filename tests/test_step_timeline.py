"""benchmarks/step_timeline.py: the GPU time per step of what runs outside the captured graph,
read from a profiler trace."""
from __future__ import annotations

from benchmarks.step_timeline import outside_graph_us


class _Trace:
    """A chrome trace as the torch profiler writes it: runtime calls and the GPU operations they
    launched, linked by correlation ids."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._next = 0

    def call(self, name: str, ts: float) -> int:
        self._next += 1
        self.events.append({"cat": "cuda_runtime", "name": name, "ts": ts, "dur": 1, "args": {"correlation": self._next}})
        return self._next

    def op(self, name: str, ts: float, dur: float, correlation: int, cat: str = "kernel") -> None:
        self.events.append({"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}})


def test_reports_per_step_time_of_operations_launched_outside_the_graph():
    trace = _Trace()
    for step in range(10):
        t = 1000.0 * step
        replay = trace.call("cudaGraphLaunch", t - 500)
        for i in range(3):  # the graph's kernels, one launch
            trace.op("_gemv_kernel", t + 10 * i, 10, replay)
        trace.op("_gemv_kernel", t + 40, 20 + step, trace.call("cuLaunchKernelEx", t - 400))  # the LM head
        trace.op("Memcpy DtoH", t + 70, 2, trace.call("cudaMemcpyAsync", t - 300), cat="gpu_memcpy")
    found = outside_graph_us(trace.events, num_steps=4)
    # The last four whole steps (replays 5 to 8; the tenth has no next replay to end it).
    assert found == {"cuLaunchKernelEx: _gemv_kernel": 20 + (5 + 6 + 7 + 8) / 4,
                     "cudaMemcpyAsync: Memcpy DtoH": 2.0}
    assert list(found) == ["cuLaunchKernelEx: _gemv_kernel", "cudaMemcpyAsync: Memcpy DtoH"]  # largest first


def test_a_trace_without_graph_replays_reports_nothing():
    trace = _Trace()
    for step in range(3):
        trace.op("_gemv_kernel", 100.0 * step, 10, trace.call("cuLaunchKernelEx", 100.0 * step - 50))
    assert outside_graph_us(trace.events, num_steps=2) == {}
