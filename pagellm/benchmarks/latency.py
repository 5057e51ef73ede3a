"""Latency per batch size: time per output token and end-to-end time of one batch.

For each batch size B, `--num-iters-warmup` untimed and `--num-iters` timed batches of B requests
(fresh random prompts each batch, so the prefix cache never serves a timed prompt; greedy, EOS
ignored), all queued at once. Time per output token is every gap between two consecutive tokens
of a request (count: iterations x B x (output_len - 1)); time to first token is per request;
end-to-end is the whole batch, per iteration. Each is reported as mean, p50 and p99.
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from tqdm.auto import tqdm

from pagellm.benchmarks.datasets import random_requests
from pagellm.benchmarks.results import format_table, run_metadata, summarize, write_json
from pagellm.benchmarks.runner import engine_summary, run_requests
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.llm import LLM
from pagellm.lora_request import LoRARequest


def run_cli(ns: argparse.Namespace) -> int:
    """`pagellm bench latency`: print a table per batch size; with --output-json also write it."""

    # The other counts are checked as the command line is parsed.
    if ns.output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (a time per output token needs two tokens), got {ns.output_len}")
    args = EngineArgs.from_cli_args(ns)
    metadata = run_metadata()
    llm = LLM(**dataclasses.asdict(args))
    results = [measure_latency(llm, b, ns.input_len, ns.output_len, ns.num_iters, ns.num_iters_warmup, args.seed,
                               progress=not ns.disable_tqdm)
               for b in ns.batch_sizes]
    print(latency_table(results))
    if ns.output_json:
        payload = {"benchmark": "latency", **metadata, "engine_args": dataclasses.asdict(args),
                   "engine": engine_summary(llm),
                   "parameters": {"batch_sizes": ns.batch_sizes, "input_len": ns.input_len,
                                  "output_len": ns.output_len, "num_iters": ns.num_iters,
                                  "num_iters_warmup": ns.num_iters_warmup, "prompts": "random token ids"},
                   "results": results}
        print("wrote", write_json(payload, ns.output_json))
    return 0


def measure_latency(llm: LLM, batch_size: int, input_len: int, output_len: int, num_iters: int,
                    num_iters_warmup: int = 1, seed: int = 0, progress: bool = False,
                    lora_request: LoRARequest | None = None) -> dict[str, Any]:
    """One batch size's numbers; see the module docstring. `lora_request`: every request's adapter."""
    engine = llm.llm_engine
    batches = num_iters_warmup + num_iters
    # Seeded by the batch size too: no two batch sizes of one run share prompts (or cache blocks).
    requests = random_requests(batch_size * batches, input_len, output_len, engine.config.model.source.arch.vocab_size,
                               seed=seed + batch_size)
    e2e, gaps, ttft = [], [], []
    for i in tqdm(range(batches), desc=f"batch size {batch_size}", disable=not progress, dynamic_ncols=True):
        run = run_requests(engine, requests[i * batch_size:(i + 1) * batch_size], token_times=True,
                           lora_requests=[lora_request] * batch_size)
        if i < num_iters_warmup:
            continue
        e2e.append(run.elapsed_s)
        for timing in run.requests:
            gaps.extend(timing.token_gaps_s)
            ttft.append(timing.first_token_s)
    return {
        "batch_size": batch_size,
        "num_iters": num_iters,
        "output_tokens_per_iter": batch_size * output_len,
        "time_per_output_token_s": summarize(gaps),
        "time_to_first_token_s": summarize(ttft),
        "end_to_end_s": summarize(e2e),
        "output_tokens_per_s": batch_size * output_len * num_iters / sum(e2e),
    }


def latency_table(results: list[dict[str, Any]]) -> str:
    """One row per batch size, milliseconds."""
    rows = []
    for r in results:
        tpot, e2e, ttft = r["time_per_output_token_s"], r["end_to_end_s"], r["time_to_first_token_s"]
        rows.append([r["batch_size"], *(1e3 * tpot[k] for k in ("mean", "p50", "p99")), 1e3 * ttft["mean"],
                     *(1e3 * e2e[k] for k in ("mean", "p50", "p99")), r["output_tokens_per_s"]])
    return format_table(["batch", "TPOT mean ms", "TPOT p50", "TPOT p99", "TTFT mean ms",
                         "e2e mean ms", "e2e p50", "e2e p99", "output tok/s"], rows)
