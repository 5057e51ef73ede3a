"""Prompt-lookup speculative decoding on one GPU: greedy identity and step cost, Llama-3.1-8B shapes.

One engine (dummy bf16 weights, Triton attention, CUDA graphs for plain decode steps) runs each
measurement twice: with its n-gram proposer, and with the proposer switched off (then async
scheduling overlaps steps again, as in an engine without speculation). Prompts repeat a phrase,
so proposals exist. Reported per batch size: output tok/s of both, tokens per step and acceptance
with speculation, the wall time of a step with and without it, and their ratio (a verification
step of 1 + k tokens runs eagerly: no CUDA graphs for it yet).

On the GPU machine, from the repository root:
    python3 -m benchmarks.spec_decode_gpu --out-dir "$OUT"
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm import LLM, SamplingParams
from benchmarks.gpu_step_profile import graph_replay_ms
from pagellm.benchmarks.results import format_table, run_metadata, write_json


def prompts(batch: int, length: int) -> list[dict[str, list[int]]]:
    """Each prompt repeats a phrase of 16 token ids of its own."""
    return [{"prompt_token_ids": ([(37 * i + 11 * j) % 30000 + 100 for j in range(16)] * length)[:length]}
            for i in range(batch)]


def timed(llm: LLM, batch: int, input_len: int, output_len: int, speculate: bool) -> dict[str, Any]:
    scheduler = llm.llm_engine.engine_core.scheduler
    proposer = scheduler.proposer
    scheduler.proposer = proposer if speculate else None
    try:
        spec = scheduler.spec_stats
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        batch_prompts = prompts(batch, input_len)
        # Warm-up past the first proposals, so that the verification path has run once.
        llm.generate(batch_prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        elapsed_runs = []
        for _ in range(3):  # the median of three: single runs varied by a third on a warm machine
            before = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_drafts)
            _sync()
            start = time.perf_counter()
            outs = llm.generate(batch_prompts, params, use_tqdm=False)
            _sync()
            elapsed_runs.append(time.perf_counter() - start)
        elapsed = statistics.median(elapsed_runs)
    finally:
        scheduler.proposer = proposer
    drafted, accepted, drafts = (spec.num_draft_tokens - before[0], spec.num_accepted_tokens - before[1],
                                 spec.num_drafts - before[2])
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # Steps: every request's sampling step gives one token plus its accepted drafts; a step serves
    # the whole batch, so steps = (tokens - accepted) / batch (the prefill step included).
    steps = (tokens - accepted) / batch
    return {"tok_s": tokens / elapsed, "elapsed_s": elapsed, "elapsed_s_runs": elapsed_runs, "tokens": tokens,
            "steps": steps, "step_ms": elapsed / steps * 1e3, "draft_tokens": drafted, "accepted_tokens": accepted,
            "verify_steps": drafts, "acceptance": accepted / drafted if drafted else None,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def graphs_check(model: str, k: int, dtype: str, max_tokens: int = 96) -> dict[str, Any]:
    """Real weights: greedy tokens of the input-grounded tasks with verification steps replayed
    from CUDA graphs, run eagerly, and without speculation (decode graphs), in one engine."""
    from benchmarks.spec_decode_cpu import TASKS  # noqa: PLC0415

    llm = LLM(model, max_model_len=1024, gpu_memory_utilization=0.3, dtype=dtype,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    runner = llm.llm_engine.engine_core.executor.worker.runner
    scheduler = llm.llm_engine.engine_core.scheduler
    conversations = [[{"role": "user", "content": text}] for text in TASKS.values()]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.chat(conversations, params, use_tqdm=False)]

    with_graphs = tokens()
    graphs, runner.graphs = runner.graphs, None
    eager = tokens()
    runner.graphs = graphs
    proposer, scheduler.proposer = scheduler.proposer, None
    plain = tokens()
    scheduler.proposer = proposer

    def equal(a: list[list[int]], b: list[list[int]]) -> int:
        return sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))

    result = {"model": model, "dtype": dtype, "tokens_total": sum(len(t) for t in plain),
              "graphs_vs_eager_equal": equal(with_graphs, eager), "graphs_vs_plain_equal": equal(with_graphs, plain),
              "eager_vs_plain_equal": equal(eager, plain), "accepted_tokens": scheduler.spec_stats.num_accepted_tokens,
              "draft_tokens": scheduler.spec_stats.num_draft_tokens}
    llm.llm_engine.shutdown()
    return result


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--load-format", default="dummy", help="dummy (random weights of the preset's shapes) or auto")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--check-model", default=None, help="real weights (a .gguf): graphs vs eager vs plain, greedy")
    p.add_argument("--check-dtypes", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    if args.check_model:
        check = [graphs_check(args.check_model, args.k, dtype) for dtype in args.check_dtypes]
        print("real weights:", check)
        if args.out_dir:
            write_json({**run_metadata(), "benchmark": "spec_decode_gpu_check", "parameters": vars(args),
                        "check": check}, Path(args.out_dir) / "spec_decode_gpu_check.json")
        return
    llm = LLM(args.model, load_format=args.load_format, max_model_len=2048,
              speculative_config={"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4})
    results, rows = [], []
    for batch in args.batch_sizes:
        spec = timed(llm, batch, args.input_len, args.output_len, True)
        plain = timed(llm, batch, args.input_len, args.output_len, False)
        same = sum(a == b for x, y in zip(spec.pop("token_ids"), plain.pop("token_ids")) for a, b in zip(x, y))
        result = {"batch": batch, "spec": spec, "plain": plain, "greedy_tokens_equal": same,
                  "greedy_tokens_total": batch * args.output_len, "speedup": spec["tok_s"] / plain["tok_s"],
                  "step_cost_ratio": spec["step_ms"] / plain["step_ms"]}
        results.append(result)
        rows.append([batch, plain["tok_s"], spec["tok_s"], result["speedup"], spec["acceptance"] or 0.0,
                     spec["tokens"] / (spec["tokens"] - spec["accepted_tokens"]), plain["step_ms"], spec["step_ms"],
                     result["step_cost_ratio"], f"{same}/{batch * args.output_len}"])
    print(format_table(["batch", "plain tok/s", "spec tok/s", "speed-up", "acceptance", "tokens/step",
                        "plain step ms", "spec step ms", "step ratio", "greedy equal"], rows))
    runner = llm.llm_engine.engine_core.executor.worker.runner
    replays = {f"{size}x{q}": graph_replay_ms(runner, size, q) for size in args.batch_sizes for q in (1, 1 + args.k)}
    print("graph replay ms:", replays, "verification replays:", runner.graphs.num_verify_replays)
    # Sampling through the verification path on the device (seeded rows, top-p): it runs, and
    # every request gets its max_tokens.
    spec = llm.llm_engine.engine_core.scheduler.spec_stats
    accepted_before = spec.num_accepted_tokens
    sampled = llm.generate(prompts(8, 64), [SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=32,
                                                           ignore_eos=True) for i in range(8)], use_tqdm=False)
    smoke = {"lengths": [len(o.outputs[0].token_ids) for o in sampled],
             "accepted_tokens": spec.num_accepted_tokens - accepted_before}
    print("sampled:", smoke)
    payload = {**run_metadata(), "benchmark": "spec_decode_gpu", "parameters": vars(args), "results": results,
               "sampled_smoke": smoke,
               "graph_replay_ms": replays, "verification_replays": runner.graphs.num_verify_replays}
    if args.out_dir:
        print(f"wrote {write_json(payload, Path(args.out_dir) / 'spec_decode_gpu.json')}")


if __name__ == "__main__":
    main()
