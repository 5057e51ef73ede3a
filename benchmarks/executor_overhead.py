"""What the process boundary costs a step: the same engine with its one rank in the engine's
process (`uni`) and in a process of its own (`mp`), in one run.

Greedy decode at batch 1 and at a larger batch (dummy weights, ignore_eos), output tokens per
second for each executor and their ratio; the greedy tokens of both must be equal. On one GPU:

    python3 -m benchmarks.executor_overhead --model meta-llama/Llama-3.1-8B-Instruct --load-format dummy

On the CPU (the embedded model): `.venv/bin/python -m benchmarks.executor_overhead --device cpu`.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json


def decode_run(llm: LLM, batch: int, input_len: int, output_len: int) -> tuple[float, list[list[int]]]:
    """Output tokens per second of `batch` greedy requests, and their tokens."""
    prompts = [{"prompt_token_ids": [(97 * i + 13 * j) % 20000 + 100 for j in range(input_len)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    # The same shapes first: Triton compiles a kernel variant on its first use.
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return batch * output_len / elapsed, [o.outputs[0].token_ids for o in outputs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/executor_overhead_*.json)")
    args = p.parse_args()

    results: dict[str, dict] = {}
    tokens: dict[str, dict[int, list[list[int]]]] = {}
    for backend in ("uni", "mp"):
        start = time.perf_counter()
        llm = LLM(args.model, load_format=args.load_format, device=args.device, max_model_len=args.max_model_len,
                  max_num_seqs=max(args.batch_sizes), distributed_executor_backend=backend)
        startup_s = time.perf_counter() - start
        results[backend], tokens[backend] = {"startup_s": startup_s}, {}
        for batch in args.batch_sizes:
            tok_s, tokens[backend][batch] = decode_run(llm, batch, args.input_len, args.output_len)
            results[backend][f"batch_{batch}_out_tok_s"] = tok_s
            print(f"{backend} batch {batch}: {tok_s:.1f} out tok/s", flush=True)
        llm.llm_engine.shutdown()
        del llm

    rows = []
    for batch in args.batch_sizes:
        uni, mp = results["uni"][f"batch_{batch}_out_tok_s"], results["mp"][f"batch_{batch}_out_tok_s"]
        rows.append([batch, f"{uni:.1f}", f"{mp:.1f}", f"{mp / uni:.3f}", tokens["uni"][batch] == tokens["mp"][batch]])
    print(format_table(["batch", "uni tok/s", "mp tok/s", "mp / uni", "same tokens"], rows))
    payload = {
        "metadata": run_metadata(),
        "config": vars(args),
        "results": results,
        "mp_over_uni": {str(r[0]): float(r[3]) for r in rows},
        "same_greedy_tokens": all(r[4] for r in rows),
    }
    path = write_json(payload, args.out or default_result_path("executor_overhead"))
    print(f"wrote {path}")
    if not payload["same_greedy_tokens"]:
        sys.exit("uni and mp gave different greedy tokens")


if __name__ == "__main__":
    main()
