"""Host and device timeline of decode steps: does the host's work hide under the GPU's?

For each batch size, `LLM.generate` of that many greedy requests (ignore_eos) runs under the torch
profiler with the engine's host phases marked (`schedule`, `launch_step`, `wait_result`,
`update_from_output`, `process_outputs`). Over the last half of the decode steps it reports the
wall time per step, the GPU's busy and idle time per step (union of kernel intervals), each host
phase's time per step, the CUDA runtime calls that cost the host most, the GPU's busy time per
step in each operation outside the captured graph (the LM head, sampling, copies) and in each of
the graph's kernels, and the replay time of the captured graph of that batch (the step's GPU
floor). With async scheduling the host's phases of step N+1 should fit under step N's kernels: GPU
idle near zero, step close to the replay.

On the GPU machine, from the repository root:
    python3 -m benchmarks.step_timeline --out-dir "$OUT"
On the CPU (the host phases only), with DIR a folder holding a small Llama's config.json:
    .venv/bin/python -m benchmarks.step_timeline --model DIR --device cpu --batch-sizes 1 64 256
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.gpu_step_profile import graph_replay_ms
from pagellm import LLM, SamplingParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json

PHASES = ("schedule", "launch_step", "wait_result", "update_from_output", "process_outputs")


class StepLog:
    """Wall time of each `LLMEngine.step()` call and the tokens its schedule handed out."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.tokens: list[int] = []

    def decode_step_ms(self, batch: int) -> float | None:
        """Median wall time of the steps that decoded one token for each of `batch` requests, the
        first and last few of a run left out (a step's call collects the step before it)."""
        times = [t for t, n in zip(self.seconds, self.tokens) if n == batch][2:-2]
        return statistics.median(times) * 1e3 if times else None


def mark_phases(llm: LLM) -> StepLog:
    """Wrap the engine's host phases in profiler ranges and time each engine step (instance
    attributes, this engine only)."""
    engine = llm.llm_engine
    core = engine.engine_core
    runner = core.executor.worker.runner
    log = StepLog()

    def marked(name: str, fn):
        def wrapper(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return wrapper

    schedule = marked("schedule", core.scheduler.schedule)

    def schedule_logged():
        so = schedule()
        log.tokens.append(so.total_num_scheduled_tokens)
        return so

    core.scheduler.schedule = schedule_logged
    core.scheduler.update_from_output = marked("update_from_output", core.scheduler.update_from_output)
    engine.output_processor.process = marked("process_outputs", engine.output_processor.process)
    launch = runner.launch_step

    def launch_marked(so):
        with torch.profiler.record_function("launch_step"):
            step = launch(so)
        step.result = marked("wait_result", step.result)
        return step

    runner.launch_step = launch_marked
    engine_step = engine.step

    def step_timed():
        start = time.perf_counter()
        try:
            return engine_step()
        finally:
            log.seconds.append(time.perf_counter() - start)

    engine.step = step_timed
    return log


def prompts_for(batch: int, input_len: int, salt: int) -> list[dict]:
    """Random prompts, distinct per salt (no prefix-cache hits between runs)."""
    rng = random.Random(salt)
    return [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(input_len)]} for _ in range(batch)]


def generate_s(llm: LLM, batch: int, input_len: int, output_len: int, salt: int) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    _sync(llm)
    start = time.perf_counter()
    llm.generate(prompts_for(batch, input_len, salt), params, use_tqdm=False)
    _sync(llm)
    return time.perf_counter() - start


def _sync(llm: LLM) -> None:
    if torch.cuda.is_available() and llm.llm_engine.config.device.type == "cuda":
        torch.cuda.synchronize()


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def step_ops_us(trace_events: list[dict], num_steps: int) -> dict[str, dict[str, float]]:
    """The GPU's busy time per step by operation over a chrome trace's last `num_steps` steps, from
    one graph replay's first operation to the next's: "outside_graph" by launching call and name (the
    LM head, sampling, the copies around the graph), "in_graph" by kernel name and grid (a model's
    projections apart where their grids differ: o_proj and down_proj of a Llama share one when their
    tiles do). An operation is charged from the end of what ran before it (or its start, after an
    idle gap) to its own end: under programmatic dependent launch a kernel starts while the one
    before still runs and waits for it, and that wait is the earlier one's. Empty without two
    replays."""
    launcher = {e["args"]["correlation"]: e["name"] for e in trace_events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = sorted((e["ts"], e["dur"], e["name"], e["args"].get("correlation"), tuple(e["args"].get("grid", ())))
                 for e in trace_events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    replays = [i for i, op in enumerate(ops) if launcher.get(op[3], "").endswith("GraphLaunch")
               and (i == 0 or ops[i - 1][3] != op[3])]
    totals: dict[str, dict[str, float]] = {"outside_graph": collections.defaultdict(float),
                                           "in_graph": collections.defaultdict(float)}
    if len(replays) >= 2:
        first, last = replays[max(0, len(replays) - 1 - num_steps)], replays[-1]
        steps = replays.index(last) - replays.index(first)
        reach = max((ts + dur for ts, dur, *_ in ops[:first]), default=float("-inf"))
        for ts, dur, name, corr, grid in ops[first:last]:
            busy = max(0.0, ts + dur - max(ts, reach))
            reach = max(reach, ts + dur)
            call = launcher.get(corr, "?")
            if call.endswith("GraphLaunch"):
                totals["in_graph"][f"{name[:90]} grid {list(grid)}"] += busy / steps
            else:
                totals["outside_graph"][f"{call}: {name[:90]}"] += busy / steps
    return {kind: dict(sorted(found.items(), key=lambda kv: -kv[1])) for kind, found in totals.items()}


def timeline(llm: LLM, batch: int, input_len: int, output_len: int, trace: Path | None,
             salt: int) -> dict[str, Any]:
    """Profile one generate; summarize its last output_len // 2 steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if llm.llm_engine.config.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        generate_s(llm, batch, input_len, output_len, salt)
    with tempfile.TemporaryDirectory() as tmp:
        path = trace or Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace_events = json.loads(path.read_text())["traceEvents"]
    events = list(prof.events())
    on_gpu = torch.autograd.DeviceType.CUDA
    # The phase ranges also appear on the GPU's timeline (user annotations): not kernels.
    launches = sorted(e.time_range.start for e in events if e.name == "launch_step" and e.device_type != on_gpu)
    num_steps = max(1, min(output_len // 2, len(launches) - 1))
    start = launches[-num_steps - 1]  # the window: from the launch before its first step to the end
    kernels = [(e.time_range.start, e.time_range.end) for e in events
               if e.device_type == on_gpu and e.name not in PHASES and e.time_range.start >= start]
    end = max([k[1] for k in kernels] + [e.time_range.end for e in events if e.time_range.start >= start])
    window = end - start
    busy = union_us([(max(s, start), e) for s, e in kernels])
    phases = collections.defaultdict(float)
    runtime = collections.defaultdict(float)
    for e in events:
        if e.time_range.start < start or e.device_type == on_gpu:
            continue
        if e.name in PHASES:
            phases[e.name] += e.time_range.end - e.time_range.start
        elif e.name.startswith("cuda"):  # runtime API calls: how long the host sat in each kind
            runtime[e.name] += e.time_range.end - e.time_range.start
    per_step = 1e-3 / num_steps
    top_runtime = sorted(runtime.items(), key=lambda kv: -kv[1])[:12]
    return {
        "steps_in_window": num_steps,
        "step_ms": window * per_step,
        "gpu_busy_ms": busy * per_step,
        "gpu_idle_ms": (window - busy) * per_step,
        "host_phase_ms": {name: phases[name] * per_step for name in PHASES},
        "cuda_runtime_ms": {name: us * per_step for name, us in top_runtime},
        **{f"{kind}_us": found for kind, found in step_ops_us(trace_events, num_steps).items()},
    }


def replay_ms(llm: LLM, batch: int) -> float | None:
    """GPU time of one replay of the captured decode graph that takes `batch` sequences."""
    runner = llm.llm_engine.engine_core.executor.worker.runner
    if runner.graphs is None or batch > runner.graphs.max_size:
        return None
    return graph_replay_ms(runner, next(s for s in runner.graphs.sizes if s >= batch))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default=None, help="default: the engine's (cuda when there is a GPU)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 512])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--quantization", default=None, help="e.g. rtn or fp8 (weights quantized at load)")
    p.add_argument("--async-scheduling", choices=("on", "off"), default=None, help="default: the engine's")
    p.add_argument("--trace-batch", type=int, default=None, help="also write the chrome trace of this batch size")
    p.add_argument("--out-dir", default=None,
                   help="where step_timeline[_QUANTIZATION].json goes; default benchmarks/results/")
    args = p.parse_args()

    engine_args: dict[str, Any] = {"load_format": args.load_format, "max_model_len": args.max_model_len,
                                   "max_num_seqs": max(args.batch_sizes), "quantization": args.quantization}
    if args.device:
        engine_args["device"] = args.device
    if args.async_scheduling:
        engine_args["async_scheduling"] = args.async_scheduling == "on"
    started = time.perf_counter()
    llm = LLM(args.model, **engine_args)
    startup_s = time.perf_counter() - started
    log = mark_phases(llm)
    rows, results = [], []
    for salt, batch in enumerate(args.batch_sizes):
        generate_s(llm, batch, args.input_len, 4, salt=100 + salt)  # warm-up
        log.seconds.clear()
        log.tokens.clear()
        generate_s(llm, batch, args.input_len, args.output_len, salt=200 + salt)
        step_ms = log.decode_step_ms(batch)
        trace = None
        if args.trace_batch == batch and args.out_dir:
            trace = Path(args.out_dir) / f"step_timeline_trace_b{batch}.json"
        found = timeline(llm, batch, args.input_len, args.output_len, trace, salt=300 + salt)
        replay = replay_ms(llm, batch) if llm.llm_engine.config.device.type == "cuda" else None
        result = {"batch": batch, "engine_step_ms": step_ms, "replay_ms": replay,
                  "step_over_replay": step_ms / replay if replay and step_ms else None, "profiled": found}
        results.append(result)
        host = found["host_phase_ms"]
        rows.append([batch, f"{step_ms:.2f}", "-" if replay is None else f"{replay:.2f}",
                     "-" if replay is None else f"{step_ms / replay:.2f}", f"{found['step_ms']:.2f}",
                     f"{found['gpu_idle_ms']:.2f}", *(f"{host[name]:.2f}" for name in PHASES)])
        print(f"batch {batch}: cuda runtime per step {found['cuda_runtime_ms']}", flush=True)
        print(f"batch {batch}: GPU us per step outside the graph:", flush=True)
        for op, us in found["outside_graph_us"].items():
            print(f"  {us:8.1f}  {op}")
        in_graph = found["in_graph_us"]
        print(f"batch {batch}: GPU busy us per step in the graph's kernels (sum {sum(in_graph.values()):.1f}):",
              flush=True)
        for op, us in in_graph.items():
            print(f"  {us:8.1f}  {op}")
    payload = {"benchmark": "step_timeline", **run_metadata(), "model": args.model, "parameters": vars(args),
               "startup_s": startup_s, "async_scheduling": llm.llm_engine.engine_core.overlap, "results": results}
    name = f"step_timeline_{args.quantization}" if args.quantization else "step_timeline"
    out = Path(args.out_dir) / f"{name}.json" if args.out_dir else default_result_path(name)
    print(format_table(["batch", "step ms", "replay ms", "step/replay", "profiled step ms", "GPU idle ms",
                        *(f"{name} ms" for name in PHASES)], rows))
    print("wrote", write_json(payload, out))


if __name__ == "__main__":
    main()
