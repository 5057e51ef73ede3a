"""benchmarks/step_timeline.py: the GPU time per step of what runs outside the captured graph and
of each of the graph's kernels, read from a profiler trace."""
from __future__ import annotations

from benchmarks.step_timeline import step_ops_us


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

    def op(self, name: str, ts: float, dur: float, correlation: int, cat: str = "kernel",
           grid: tuple[int, ...] = (1, 1, 1)) -> None:
        self.events.append({"cat": cat, "name": name, "ts": ts, "dur": dur,
                            "args": {"correlation": correlation, "grid": list(grid)}})


def test_reports_per_step_busy_time_of_operations_outside_the_graph_and_of_its_kernels():
    trace = _Trace()
    for step in range(10):
        t = 1000.0 * step
        replay = trace.call("cudaGraphLaunch", t - 500)
        for i in range(2):  # the graph's kernels, one launch: two layers' projections of two shapes
            trace.op("_gemv_kernel", t + 30 * i, 10, replay, grid=(384, 1, 1))
            # Started early (dependent launch): it waits 4 us for the kernel before it, whose time that is.
            trace.op("_gemv_kernel", t + 30 * i + 6, 4 + 5 + step, replay, grid=(256, 1, 1))
            trace.op("_rms_norm_kernel", t + 30 * i + 25, 2, replay)  # after an idle gap
        trace.op("_gemv_kernel", t + 60, 20 + step, trace.call("cuLaunchKernelEx", t - 400))  # the LM head
        trace.op("Memcpy DtoH", t + 90, 2, trace.call("cudaMemcpyAsync", t - 300), cat="gpu_memcpy")
    found = step_ops_us(trace.events, num_steps=4)
    # The last four whole steps (replays 5 to 8; the tenth has no next replay to end it).
    assert found["outside_graph"] == {"cuLaunchKernelEx: _gemv_kernel": 20 + (5 + 6 + 7 + 8) / 4,
                                      "cudaMemcpyAsync: Memcpy DtoH": 2.0}
    assert list(found["outside_graph"]) == ["cuLaunchKernelEx: _gemv_kernel", "cudaMemcpyAsync: Memcpy DtoH"]
    assert found["in_graph"] == {"_gemv_kernel grid [256, 1, 1]": 2 * (5 + (5 + 6 + 7 + 8) / 4),
                                 "_gemv_kernel grid [384, 1, 1]": 20.0, "_rms_norm_kernel grid [1, 1, 1]": 4.0}
    assert list(found["in_graph"])[0] == "_gemv_kernel grid [256, 1, 1]"  # largest first


def test_a_trace_without_graph_replays_reports_nothing():
    trace = _Trace()
    for step in range(3):
        trace.op("_gemv_kernel", 100.0 * step, 10, trace.call("cuLaunchKernelEx", 100.0 * step - 50))
    assert step_ops_us(trace.events, num_steps=2) == {"outside_graph": {}, "in_graph": {}}
