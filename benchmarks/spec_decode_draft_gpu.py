"""Draft-model speculative decoding on one GPU: correctness of the draft's passes, and what they cost.

1. Self-drafting check: a model drafting for itself with the same weights (Llama-3.2-1B shapes,
   dummy float32 weights, the same seed) must have nearly every draft accepted (a draft KV slot or
   position off by one drops acceptance to chance) and give the greedy tokens of the same engine
   with speculation off.
2. Cost: Llama-3.1-8B target with a Llama-3.2-1B draft (dummy bfloat16 weights, k drafts): CUDA
   graph replay times of the target's decode and verification steps and of the draft's passes
   (one token per request, and 1 + k: its catch-up after a verification), then output tok/s with
   and without speculation. Random weights make the two models disagree, so nearly every draft is
   rejected: the tok/s ratio is what proposing and verifying cost, not a speed-up.

On the GPU machine, from the repository root:
    python3 -m benchmarks.spec_decode_draft_gpu --out-dir "$OUT"
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

from benchmarks.gpu_step_profile import graph_replay_ms
from benchmarks.spec_decode_gpu import prompts
from pagellm import LLM, SamplingParams
from pagellm.benchmarks.results import format_table, run_metadata, write_json


def switched(llm: LLM, on: bool):
    """Speculation on or off in a running engine (the drafter and the scheduler's use of it)."""
    core = llm.llm_engine.engine_core
    runner = core.executor.worker.runner
    if not hasattr(llm, "_saved_spec"):
        llm._saved_spec = (runner.drafter, core.scheduler.speculative)
    drafter, speculative = llm._saved_spec
    runner.drafter = drafter if on else None
    core.scheduler.speculative = speculative if on else None


def generate(llm: LLM, batch: int, input_len: int, output_len: int, on: bool, repeats: int) -> dict[str, Any]:
    switched(llm, on)
    spec = llm.llm_engine.engine_core.scheduler.spec_stats
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    batch_prompts = prompts(batch, input_len)
    llm.generate(batch_prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    runs, before = [], (spec.num_draft_tokens, spec.num_accepted_tokens)
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(batch_prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    switched(llm, True)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafted, accepted = spec.num_draft_tokens - before[0], spec.num_accepted_tokens - before[1]
    return {"tok_s": tokens / statistics.median(runs), "elapsed_s_runs": runs, "tokens": tokens,
            "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "token_ids": [o.outputs[0].token_ids for o in outs]}


def self_check(model: str, k: int, batch: int, dtype: str) -> dict[str, Any]:
    llm = LLM(model, load_format="dummy", dtype=dtype, max_model_len=1024, gpu_memory_utilization=0.3,
              speculative_config={"model": model, "num_speculative_tokens": k})
    spec = generate(llm, batch, 96, 64, True, 1)
    plain = generate(llm, batch, 96, 64, False, 1)
    equal = sum(a == b for x, y in zip(spec.pop("token_ids"), plain.pop("token_ids")) for a, b in zip(x, y))
    drafter = llm.llm_engine.engine_core.executor.worker.runner.drafter
    result = {"model": model, "dtype": dtype, "k": k, "batch": batch, "acceptance": spec["acceptance"],
              "draft_tokens": spec["draft_tokens"], "greedy_tokens_equal": equal, "greedy_tokens_total": plain["tokens"],
              "draft_verify_replays": drafter.graphs.num_verify_replays}
    llm.llm_engine.shutdown()
    del llm
    torch.cuda.empty_cache()
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--draft", default="llama-3.2-1b")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    check = [self_check(args.draft, args.k, batch, "float32") for batch in (1, 8)]
    print("self-drafting:", check)
    llm = LLM(args.model, load_format="dummy", max_model_len=2048,
              speculative_config={"model": args.draft, "num_speculative_tokens": args.k})
    runner = llm.llm_engine.engine_core.executor.worker.runner
    results, rows = [], []
    for batch in args.batch_sizes:
        spec = generate(llm, batch, args.input_len, args.output_len, True, args.repeats)
        plain = generate(llm, batch, args.input_len, args.output_len, False, args.repeats)
        same = sum(a == b for x, y in zip(spec.pop("token_ids"), plain.pop("token_ids")) for a, b in zip(x, y))
        replay = {"target_decode": graph_replay_ms(runner, batch), "target_verify": graph_replay_ms(runner, batch, 1 + args.k),
                  "draft_decode": graph_replay_ms(runner.drafter, batch),
                  "draft_catch_up": graph_replay_ms(runner.drafter, batch, 1 + args.k)}
        # A speculative step: the target's verification, the draft's catch-up and k - 1 decodes.
        step = replay["target_verify"] + replay["draft_catch_up"] + (args.k - 1) * replay["draft_decode"]
        results.append({"batch": batch, "spec": spec, "plain": plain, "greedy_tokens_equal": same,
                        "graph_replay_ms": replay, "speculative_step_graphs_ms": step,
                        "speculative_step_vs_decode": step / replay["target_decode"]})
        rows.append([batch, plain["tok_s"], spec["tok_s"], spec["tok_s"] / plain["tok_s"], spec["acceptance"] or 0.0,
                     replay["target_decode"], replay["target_verify"], replay["draft_decode"], replay["draft_catch_up"],
                     step / replay["target_decode"], f"{same}/{plain['tokens']}"])
    print(format_table(["batch", "plain tok/s", "spec tok/s", "ratio", "acceptance", "target decode ms",
                        "target verify ms", "draft decode ms", "draft catch-up ms", "spec step / decode",
                        "greedy equal"], rows))
    payload = {**run_metadata(), "benchmark": "spec_decode_draft_gpu", "parameters": vars(args),
               "self_drafting": check, "results": results}
    if args.out_dir:
        print(f"wrote {write_json(payload, Path(args.out_dir) / 'spec_decode_draft_gpu.json')}")


if __name__ == "__main__":
    main()
