"""Offline throughput: every request queued at once, as `vllm bench throughput` does.

Greedy sampling, EOS ignored (every request produces exactly its output length), after a short
warm-up on other prompts (so neither the timed prompts' prefix-cache blocks nor first-call costs
leak into the measurement). Reports requests/s, total (prompt + output) tokens/s and output tokens/s.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pagellm.benchmarks.datasets import BenchRequest, dataset_requests, random_requests
from pagellm.benchmarks.results import run_metadata, write_json
from pagellm.benchmarks.runner import RunResult, engine_summary, run_requests
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.llm import LLM
from pagellm.loader import resolve_model
from pagellm.lora_request import LoRARequest

_WARMUP = {"num": 2, "input_len": 16, "output_len": 4}
_WARMUP_SEED = -1
"""No benchmark's own seed: the warm-up must not leave the timed prompts' blocks in the prefix cache."""


def run_cli(ns: argparse.Namespace) -> int:
    """`pagellm bench throughput`: print the numbers; with --output-json also write them."""
    args = EngineArgs.from_cli_args(ns)
    requests, dataset = dataset_requests(ns.dataset, ns.num_prompts, resolve_model(args.model, args.load_format),
                                         args.seed, ns.input_len, ns.output_len, ns.random_range_ratio,
                                         ns.dataset_path, prefix_len=ns.prefix_len, num_prefixes=ns.num_prefixes)
    metadata = run_metadata()
    llm = LLM(**dataclasses.asdict(args))
    result, _ = measure_throughput(llm, requests, progress=not ns.disable_tqdm)
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, {result['total_tokens_per_s']:.2f} total tokens/s, "
          f"{result['output_tokens_per_s']:.2f} output tokens/s")
    print(f"({result['num_requests']} requests, {result['prompt_tokens']} prompt + {result['output_tokens']} output "
          f"tokens in {result['elapsed_s']:.2f} s)")
    if ns.output_json:
        payload = {"benchmark": "throughput", **metadata, "engine_args": dataclasses.asdict(args),
                   "engine": engine_summary(llm), "dataset": dataset, "results": result}
        print("wrote", write_json(payload, ns.output_json))
    return 0


def measure_throughput(llm: LLM, requests: list[BenchRequest], deadline: float | None = None,
                       progress: bool = False, before_timed: Callable[[], None] | None = None,
                       lora_requests: Sequence[LoRARequest | None] | None = None) -> tuple[dict[str, Any], RunResult]:
    """Warm up, then time `requests` (see the module docstring): the numbers and the run they came
    from. `deadline` (perf_counter seconds) cuts a long run short: the numbers then say
    `complete: False` and count what was done. `before_timed` is called between the warm-up and
    the timed run (a benchmark starting its own records). `lora_requests`: each request's adapter."""
    engine = llm.llm_engine
    warmup = random_requests(_WARMUP["num"], _WARMUP["input_len"], _WARMUP["output_len"],
                             engine.config.model.source.arch.vocab_size, _WARMUP_SEED)
    run_requests(engine, warmup)
    if before_timed is not None:
        before_timed()
    run = run_requests(engine, requests, deadline=deadline, progress=progress, lora_requests=lora_requests)
    return throughput_numbers(run), run


def throughput_numbers(run: RunResult) -> dict[str, Any]:
    """Counts and rates of a run. A partial run counts the prompts of the requests that produced a
    token and the requests that finished."""
    finished = [r for r in run.requests if r.finished]
    prompt_tokens = sum(r.prompt_tokens for r in run.requests if r.output_tokens)
    total = prompt_tokens + run.output_tokens
    return {
        "complete": run.complete,
        "elapsed_s": run.elapsed_s,
        "num_requests": len(run.requests),
        "num_finished_requests": len(finished),
        "num_steps": run.num_steps,
        "prompt_tokens": prompt_tokens,
        "output_tokens": run.output_tokens,
        "total_tokens": total,
        "requests_per_s": len(finished) / run.elapsed_s,
        "output_tokens_per_s": run.output_tokens / run.elapsed_s,
        "total_tokens_per_s": total / run.elapsed_s,
    }
