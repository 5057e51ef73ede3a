"""Where a decode step's time goes on the GPU: graph replay (GPU work) against the whole engine step.

For each batch size: the engine's steady decode step time (wall, from `LLM.generate` with every
request decoding), the replay time of the captured CUDA graph of the model's forward alone
(CUDA events) on the inputs of the run's last decode step, still in the graph's buffers (so its
attention reads as many keys as the steps did; the graph's capture inputs are sequences of one
token), the eager forward's time, and so the host's share of the step. A cProfile of
one run at the largest batch shows which host functions cost most.

On the GPU machine, from the repository root:
    python3 -m benchmarks.gpu_step_profile --out-dir "$OUT"
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.results import format_table, run_metadata, write_json


def replay_ms(graph: torch.cuda.CUDAGraph, iters: int = 50) -> float:
    """GPU time of one replay of `graph`: the mean of `iters` back-to-back replays (CUDA events)."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def graph_replay_ms(runner: Any, size: int, q: int = 1, iters: int = 50) -> float:
    """GPU time of one replay of the captured graph of `size` sequences of `q` tokens."""
    return replay_ms(runner.graphs.graph(size, q), iters)


def kernel_times_us(step: Callable[[], object], iters: int = 10) -> dict[str, Any]:
    """GPU time per call of `step` by kernel name (the torch profiler), slowest first (at most 40)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
        if us > 0:
            kernels.append({"name": evt.key[:120], "calls_per_step": evt.count / iters, "us_per_step": us / iters})
    kernels.sort(key=lambda r: -r["us_per_step"])
    return {"sum_us_per_step": sum(r["us_per_step"] for r in kernels), "kernels": kernels[:40]}


def kernel_breakdown(runner: Any, size: int, iters: int = 10) -> dict[str, Any]:
    """GPU time per decode step by kernel name, for the graph replay of `size` rows and for the same
    forward run eagerly (launch gaps show as the difference between the sum and the step time).
    Under programmatic dependent launch (Hopper) a kernel counts from its early start, while it
    waits for the one before: the sums then exceed the step, and only the replay time is the step's."""
    graph = runner.graphs.graph(size)
    md = runner.graphs._metadata(size)
    ids, positions = runner.graphs.input_ids[:size], runner.graphs.positions[:size]
    return {label: kernel_times_us(step, iters)
            for label, step in (("graph", graph.replay), ("eager", lambda: runner.model(ids, positions, md)))}


def engine_step_ms(llm: LLM, batch: int, input_len: int, output_len: int) -> float:
    """Wall time per decode step: (generate with output_len) - (generate with 1 token), over the steps."""
    prompts = [{"prompt_token_ids": [(7 * i + j) % 30000 + 100 for j in range(input_len)]} for i in range(batch)]

    def run(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    run(2)
    return (run(output_len) - run(1)) / (output_len - 1) * 1e3


def graph_vs_eager(llm: LLM, runner: Any, batch: int = 8, tokens: int = 32) -> dict[str, Any]:
    """Greedy tokens with the decode graphs and with them switched off, same engine and weights."""
    prompts = [{"prompt_token_ids": [(11 * i + j) % 30000 + 100 for j in range(40 + i)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with_graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    graphs, runner.graphs = runner.graphs, None
    try:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        runner.graphs = graphs
    same = sum(a == b for x, y in zip(with_graphs, eager) for a, b in zip(x, y))
    return {"tokens_equal": same, "tokens_total": batch * tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--quantization", default=None, help="e.g. rtn or fp8 (weights quantized at load)")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--skip-profile", action="store_true", help="no cProfile run at the largest batch")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()

    t = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, quantization=args.quantization,
              kv_cache_dtype=args.kv_cache_dtype)
    startup_s = time.perf_counter() - t
    runner = llm.llm_engine.engine_core.executor.worker.runner
    check = graph_vs_eager(llm, runner)
    print("graphs vs eager:", check)
    rows, results = [], []
    for batch in args.batch_sizes:
        size = next(s for s in runner.graphs.sizes if s >= batch)
        step = engine_step_ms(llm, batch, args.input_len, args.output_len)
        replay = graph_replay_ms(runner, size)  # after the run: its last step's inputs
        results.append({"batch": batch, "graph_size": size, "replay_ms": replay, "engine_step_ms": step,
                        "host_ms": step - replay, "tok_per_s": batch / step * 1e3})
        rows.append([batch, f"{replay:.2f}", f"{step:.2f}", f"{step - replay:.2f}", f"{batch / step * 1e3:.0f}"])

    breakdown = {size: kernel_breakdown(runner, size) for size in {1, runner.graphs.max_size}}
    for size, found in breakdown.items():
        for label, table in found.items():
            print(f"batch {size} {label}: kernels sum {table['sum_us_per_step']:.0f} us per step")
            for r in table["kernels"][:20]:
                print(f"  {r['us_per_step']:9.1f} us  x{r['calls_per_step']:5.0f}  {r['name']}")

    text = io.StringIO()
    if not args.skip_profile:
        profile = cProfile.Profile()
        batch = args.batch_sizes[-1]
        prompts = [{"prompt_token_ids": [(5 * i + j) % 30000 + 100 for j in range(args.input_len)]}
                   for i in range(batch)]
        profile.enable()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
                     use_tqdm=False)
        profile.disable()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(40)

    payload = {**run_metadata(), "model": args.model, "quantization": args.quantization,
               "kv_cache_dtype": args.kv_cache_dtype, "startup_s": startup_s, "graph_vs_eager": check, "steps": results,
               "graph_sizes": runner.graphs.sizes, "kernel_breakdown": breakdown, "profile_top": text.getvalue()}
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / f"gpu_step_profile_{args.quantization or 'bf16'}.json")
    print(text.getvalue()[:6000])
    print(f"start-up {startup_s:.1f} s")
    print(format_table(["batch", "graph replay ms", "engine step ms", "host ms", "tok/s"], rows))


if __name__ == "__main__":
    main()
