"""Where a throughput run's time goes: each engine step against its serial floor, by kind of step.

The ShareGPT requests (or random ones) run through `LLM` as `gpu_fast_path` runs them. Each step's
composition is read when it is launched (decodes and the keys they attend to, prompt tokens and
their (query, key) pairs, rows sampled) and the time its result comes back is recorded; a step's
cost is the time between its result and the one before (the device runs steps back to back, so
this is the step's share of the run, host gaps included). Steps are grouped by kind (prompt chunks
present; else by decode batch) and each group's time is set against the sum of its steps' serial
floors (`roofline.serial_step_s`: max(weights, matmul FLOPs) plus attention, at the ceilings this
run measures), so the groups that lose most against what a serial step allows stand out.

With `--overlap`, the same engine's model then times decode forwards of fixed shapes captured in
CUDA graphs three ways: the whole batch, its two halves one after the other, and its two halves on
two streams (nothing orders one half's kernels after the other's, so the GPU may run one half's
attention beside the other's matmuls). It says whether splitting a step across streams can hide
attention under the matmuls on this GPU with these kernels, before any engine is built around it.

On the GPU machine, from the repository root:
    python3 -m benchmarks.step_trace --overlap --out-dir "$OUT"
On the CPU (the trace only), with DIR a folder holding a small Llama's config.json:
    .venv/bin/python -m benchmarks.step_trace --model DIR --device cpu --num-prompts 16
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from benchmarks.gpu_step_profile import kernel_times_us, replay_ms
from pagellm import LLM
from pagellm.attention.backend import AttentionMetadata
from pagellm.benchmarks.datasets import load_requests, random_requests
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import Ceilings, ModelCost, measure_ceilings, serial_step_s, sum_range
from pagellm.benchmarks.throughput import measure_throughput

DEFAULT_REQUESTS = str(Path(__file__).resolve().parent / "data" / "sharegpt_1000_seed0.json.gz")
DECODE_GROUPS = ((1, 1), (2, 2), (3, 8), (9, 32), (33, 128), (129, 256), (257, 512), (513, 1024))
"""The decode-only groups of steps, by decodes per step (larger steps: one group more)."""
GROUP_NAMES = ["prompt chunks", *(f"decode {lo}-{hi}" for lo, hi in DECODE_GROUPS), f"decode > {DECODE_GROUPS[-1][1]}"]


@dataclass(slots=True)
class StepRecord:
    decodes: int
    prompt_tokens: int
    sampled: int
    kv_tokens: int
    """Keys the step's decodes attend to, summed."""
    prompt_pairs: int
    """(query, key) pairs of the step's prompt chunks."""
    done_s: float = 0.0
    """perf_counter when the step's result came back."""


def trace_steps(llm: LLM) -> list[StepRecord]:
    """Record each step this engine launches from now on (instance attributes: this engine only)."""
    core = llm.llm_engine.engine_core
    scheduler, executor = core.scheduler, core.executor
    records: list[StepRecord] = []
    launched: collections.deque[StepRecord] = collections.deque()
    execute, collect = executor.execute_model, core._collect

    def execute_traced(so):
        decodes = prompt_tokens = sampled = kv_tokens = prompt_pairs = 0
        for req_id, n in so.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            end = request.num_computed_tokens  # already advanced past this step's tokens by schedule()
            prompt = len(request.prompt_token_ids)
            if end - n >= prompt:  # generated tokens: decodes (and drafts)
                decodes += n
                kv_tokens += sum_range(end - n + 1, end)
            else:
                prompt_tokens += n
                prompt_pairs += sum_range(end - n + 1, end)
            sampled += end >= prompt
        record = StepRecord(decodes, prompt_tokens, sampled, kv_tokens, prompt_pairs)
        launched.append(record)
        return execute(so)

    def collect_traced():
        outputs = collect()
        record = launched.popleft()
        record.done_s = time.perf_counter()
        records.append(record)
        return outputs

    executor.execute_model = execute_traced
    core._collect = collect_traced
    return records


def group_of(record: StepRecord) -> str:
    if record.prompt_tokens:
        return GROUP_NAMES[0]
    return next((GROUP_NAMES[1 + i] for i, (_, hi) in enumerate(DECODE_GROUPS) if record.decodes <= hi),
                GROUP_NAMES[-1])


def summarize(records: list[StepRecord], start_s: float, cost: ModelCost, ceilings: Ceilings) -> list[dict[str, Any]]:
    """Per group: steps, seconds taken, serial floor (matmuls, attention), floor / taken."""
    groups: dict[str, dict[str, Any]] = {}
    previous = start_s
    for r in records:
        taken, previous = r.done_s - previous, r.done_s
        matmul, attention = serial_step_s(cost, ceilings, r.decodes + r.prompt_tokens, r.sampled, r.kv_tokens,
                                          r.prompt_pairs)
        g = groups.setdefault(group_of(r), {"steps": 0, "taken_s": 0.0, "matmul_floor_s": 0.0,
                                            "attention_floor_s": 0.0, "decodes": 0, "prompt_tokens": 0})
        g["steps"] += 1
        g["taken_s"] += taken
        g["matmul_floor_s"] += matmul
        g["attention_floor_s"] += attention
        g["decodes"] += r.decodes
        g["prompt_tokens"] += r.prompt_tokens
    rows = []
    for name in GROUP_NAMES:
        if name in groups:
            g = groups[name]
            floor = g["matmul_floor_s"] + g["attention_floor_s"]
            rows.append({"group": name, **g, "serial_floor_s": floor, "floor_over_taken": floor / g["taken_s"],
                         "ms_per_step": g["taken_s"] / g["steps"] * 1e3})
    return rows


# -- two streams ------------------------------------------------------------------------------------

def decode_inputs(batch: int, context: int, block_size: int, first_block: int, device: torch.device,
                  vocab: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step of `batch` sequences of `context` tokens each (its last one computed now),
    each in its own blocks from `first_block` on, in shuffled order as a used cache holds them."""
    per_seq = -(-context // block_size)
    gen = torch.Generator().manual_seed(first_block)
    blocks = first_block + torch.randperm(batch * per_seq, generator=gen)
    table = blocks.view(batch, per_seq).to(torch.int32)
    slot = table[:, (context - 1) // block_size].to(torch.int64) * block_size + (context - 1) % block_size
    md = AttentionMetadata(
        num_tokens=batch, query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device), block_table=table.to(device),
        slot_mapping=slot.to(device), max_query_len=1, max_seq_len=context,
        query_start_loc_cpu=np.arange(batch + 1, dtype=np.int32), seq_lens_cpu=np.full(batch, context, np.int32))
    ids = torch.randint(0, vocab, (batch,), generator=gen).to(device)
    positions = torch.full((batch,), context - 1, dtype=torch.int64, device=device)
    return ids, positions, md


def capture(fn) -> torch.cuda.CUDAGraph:
    fn()  # compiles and settles the allocator
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


@torch.inference_mode()
def overlap_probe(llm: LLM, shapes: list[tuple[int, int]], iters: int) -> list[dict[str, Any]]:
    """Per (batch, context): graph replay of the whole batch, of its halves in turn, and of its
    halves on two streams; and how far the first half's two-stream hidden states are from its own
    run alone."""
    runner = llm.llm_engine.engine_core.executor.worker.runner
    model, device, block_size = runner.model, runner.device, runner.block_size
    vocab = runner.arch.vocab_size
    num_blocks = runner.kv_caches[0][0].shape[0]
    for k, v in runner.kv_caches:  # keys and values as a used cache holds them, not zeros
        k.uniform_(-1, 1)
        v.uniform_(-1, 1)
    side = torch.cuda.Stream(device)
    results = []
    for batch, context in shapes:
        per_seq = -(-context // block_size)
        if batch * per_seq + 1 > num_blocks:
            results.append({"batch": batch, "context": context, "skipped": f"needs {batch * per_seq} blocks"})
            continue
        half = batch // 2
        whole = decode_inputs(batch, context, block_size, 1, device, vocab)
        ids, positions, md = whole
        a = decode_inputs(half, context, block_size, 1, device, vocab)
        b = decode_inputs(batch - half, context, block_size, 1 + half * per_seq, device, vocab)
        out: dict[str, torch.Tensor] = {}

        def run_whole():
            out["whole"] = model(ids, positions, md)

        def run_halves():
            out["a"], out["b"] = model(*a), model(*b)

        def run_streams():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            out["a"] = model(*a)
            with torch.cuda.stream(side):
                out["b"] = model(*b)
            main.wait_stream(side)

        row: dict[str, Any] = {"batch": batch, "context": context}
        for name, fn in (("whole_ms", run_whole), ("halves_in_turn_ms", run_halves), ("halves_two_streams_ms", run_streams)):
            graph = capture(fn)
            row[name] = replay_ms(graph, iters)
            if name == "whole_ms":
                row["whole_kernels"] = kernel_times_us(graph.replay, iters)
            del graph
        kernels = row["whole_kernels"]
        attention = sum(k["us_per_step"] for k in kernels["kernels"] if "attention" in k["name"] or "merge" in k["name"])
        row["whole_attention_ms"] = attention / 1e3
        row["whole_other_kernels_ms"] = (kernels["sum_us_per_step"] - attention) / 1e3
        ref = model(*a)  # the first half alone: running beside the other half must not change it
        row["two_streams_vs_in_turn_max_abs"] = float((out["a"].float() - ref.float()).abs().max())
        row["two_streams_over_whole"] = row["halves_two_streams_ms"] / row["whole_ms"]
        row["two_streams_over_in_turn"] = row["halves_two_streams_ms"] / row["halves_in_turn_ms"]
        results.append(row)
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--device", default=None)
    p.add_argument("--requests", default=DEFAULT_REQUESTS, help="a requests file (gpu_fast_path's ShareGPT set)")
    p.add_argument("--random", type=int, nargs=2, metavar=("INPUT_LEN", "OUTPUT_LEN"), default=None,
                   help="random requests of these lengths instead of --requests")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--overlap", action="store_true", help="also the two-stream probe (CUDA only)")
    p.add_argument("--overlap-shapes", type=int, nargs="+", default=[384, 1536, 192, 1536, 256, 384, 512, 384,
                                                                     64, 1024],
                   help="batch, context pairs")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)

    kwargs = {"device": args.device} if args.device else {}
    llm = LLM(args.model, load_format="dummy", max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              **kwargs)
    config = llm.llm_engine.config
    cost = ModelCost.from_arch(config.model.source.arch, config.model.dtype.itemsize)
    if config.device.type == "cuda":
        ceilings, ceiling_record = measure_ceilings(config.device, 1 << 30, 8192, config.model.dtype, 20)
    else:  # nominal: the CPU run checks the bookkeeping, not the machine
        ceilings, ceiling_record = Ceilings(1e11, 1e12), {"nominal": True}
    if args.random:
        requests = random_requests(args.num_prompts, *args.random, config.model.source.arch.vocab_size, 0)
    else:
        requests = load_requests(args.requests)[0][:args.num_prompts]
    traced: dict[str, Any] = {}

    def start_trace() -> None:
        traced["records"] = trace_steps(llm)
        traced["start"] = time.perf_counter()

    numbers, run = measure_throughput(llm, requests, before_timed=start_trace)
    records = traced["records"]
    groups = summarize(records, traced["start"], cost, ceilings)
    total_floor = sum(g["serial_floor_s"] for g in groups)
    print(format_table(["steps", "group", "taken s", "ms/step", "serial floor s", "matmul", "attention",
                        "floor / taken"],
                       [[g["steps"], g["group"], f"{g['taken_s']:.2f}", f"{g['ms_per_step']:.2f}",
                         f"{g['serial_floor_s']:.2f}", f"{g['matmul_floor_s']:.2f}", f"{g['attention_floor_s']:.2f}",
                         f"{g['floor_over_taken']:.2f}"] for g in groups], left=[1]))
    print(f"run {run.elapsed_s:.2f} s, {numbers['requests_per_s']:.1f} req/s, {len(records)} steps; "
          f"serial floor of these steps {total_floor:.2f} s ({total_floor / run.elapsed_s:.2f} of the run)")
    payload: dict[str, Any] = {
        "benchmark": "step_trace", **run_metadata(), "model": args.model,
        "requests": f"random {args.random}" if args.random else args.requests, "num_prompts": len(requests),
        "max_num_seqs": config.scheduler.max_num_seqs, "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "ceilings": ceiling_record, "throughput": numbers, "groups": groups,
        "steps": [asdict(r) | {"done_s": r.done_s - traced["start"]} for r in records]}
    if args.overlap:
        if config.device.type != "cuda":
            raise SystemExit("--overlap needs a CUDA device")
        shapes = list(zip(args.overlap_shapes[::2], args.overlap_shapes[1::2]))
        payload["overlap"] = overlap_probe(llm, shapes, args.iters)
        keys = ("whole_ms", "whole_attention_ms", "whole_other_kernels_ms", "halves_in_turn_ms",
                "halves_two_streams_ms", "two_streams_over_whole", "two_streams_vs_in_turn_max_abs")
        print(format_table(["batch", "context", "whole ms", "its attention", "its other kernels", "halves in turn",
                            "two streams", "streams / whole", "max |diff|"],
                           [[r["batch"], r["context"], *(f"{r[k]:.3f}" for k in keys)] if "whole_ms" in r else
                            [r["batch"], r["context"], r["skipped"], *[""] * (len(keys) - 1)]
                            for r in payload["overlap"]]))
    path = default_result_path("step_trace")
    paths = [write_json(payload, path)]
    if args.out_dir:
        paths.append(write_json(payload, Path(args.out_dir) / path.name))
    print("wrote", ", ".join(map(str, paths)))
    return payload


if __name__ == "__main__":
    main()
