"""Offline throughput on CPU: pagellm's `LLM.generate` against Hugging Face batched `generate`.

Both run in this process, one after the other, on the same prompts: random token ids with input
lengths uniform in [--min-input-len, --max-input-len] and --output-len tokens each (EOS ignored),
greedy, in --dtype (for both unless --hf-dtype is given; default float32). pagellm gets all prompts in one `generate` call; HF gets static batches of
--hf-batch-size. Model loading is excluded from the timed runs and reported on its own
(pagellm: `LLM(...)` construction up to ready; HF: `from_pretrained`). Both are warmed up first
on other prompts, so pagellm's prefix cache cannot serve the timed prompts from the warm-up.
pagellm's time includes its incremental detokenization; HF's `generate` returns ids only.

Run from the repository root:
    .venv/bin/python -m benchmarks.bench_offline_cpu            # 64 prompts x 128 tokens, SmolLM2
    .venv/bin/python -m benchmarks.bench_offline_cpu --num-prompts 4 --output-len 8 --output-json /tmp/x.json
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a file path (python benchmarks/bench_offline_cpu.py): make `benchmarks` importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.datasets import BenchRequest, random_requests_in_range
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.loader import default_model_path, resolve_model

_WARMUP_PROMPTS = 2
_WARMUP_INPUT_LEN = 32
_WARMUP_OUTPUT_LEN = 8


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    model_path = args.model or default_model_path()
    vocab_size = resolve_model(model_path).arch.vocab_size
    requests = random_requests_in_range(args.num_prompts, args.min_input_len, args.max_input_len,
                                        args.output_len, vocab_size, args.seed)
    # A different seed: the warm-up must not leave the timed prompts' blocks in the prefix cache.
    warmup = random_requests_in_range(_WARMUP_PROMPTS, _WARMUP_INPUT_LEN, _WARMUP_INPUT_LEN,
                                      _WARMUP_OUTPUT_LEN, vocab_size, args.seed + 1)

    metadata = run_metadata()
    ours, our_token_ids = _run_pagellm(model_path, requests, warmup, args)
    results: dict[str, Any] = {"pagellm": ours}
    gc.collect()  # the engine is out of scope: free its weights and KV cache before HF loads its copy
    if not args.skip_hf:
        hf, hf_token_ids = _run_hf(model_path, requests, warmup, args.hf_batch_size, args.hf_dtype or args.dtype)
        results["hf"] = hf
        ours["ratio_vs_hf"] = ours["output_tokens_per_s"] / hf["output_tokens_per_s"]
        hf["ratio_vs_hf"] = 1.0
        results["greedy_agreement"] = _agreement(our_token_ids, hf_token_ids)

    payload = {
        "benchmark": "offline_cpu",
        **metadata,
        "parameters": {
            "model": model_path,
            "dataset": "random token ids",
            "num_prompts": args.num_prompts,
            "min_input_len": args.min_input_len,
            "max_input_len": args.max_input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "hf_batch_size": None if args.skip_hf else args.hf_batch_size,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "dtype": args.dtype,
            "hf_dtype": args.hf_dtype or args.dtype,
            "device": "cpu",
            "greedy": True,
            "ignore_eos": True,
            "total_input_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "warmup": {"prompts": _WARMUP_PROMPTS, "input_len": _WARMUP_INPUT_LEN, "output_len": _WARMUP_OUTPUT_LEN},
        },
        "results": results,
    }
    print(_summary(payload))
    if not args.no_save:
        path = write_json(payload, args.output_json or default_result_path("offline_cpu"))
        print(f"\nwrote {path}")
    return payload


def _run_pagellm(model_path: str, requests: list[BenchRequest], warmup: list[BenchRequest],
                 args: argparse.Namespace) -> tuple[dict[str, Any], list[list[int]]]:
    """pagellm's timings and results, and its output token ids per request."""
    start = time.perf_counter()
    engine_kwargs: dict[str, Any] = {"dtype": args.dtype, "device": "cpu", "seed": args.seed}
    if args.max_num_batched_tokens is not None:
        engine_kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    llm = LLM(model_path, **engine_kwargs)
    startup_s = time.perf_counter() - start

    _pagellm_generate(llm, warmup)
    elapsed, outputs = _pagellm_generate(llm, requests)
    token_ids = [out.outputs[0].token_ids for out in outputs]
    got, wanted = sum(map(len, token_ids)), sum(r.output_len for r in requests)
    if got != wanted:
        raise RuntimeError(f"pagellm generated {got} tokens, {wanted} were requested (ignore_eos is set)")
    config = llm.llm_engine.config
    result = {
        "startup_s": startup_s,
        "elapsed_s": elapsed,
        "num_requests": len(requests),
        "output_tokens": got,
        "output_tokens_per_s": got / elapsed,
        "prefix_cache_hit_tokens": sum(out.num_cached_tokens for out in outputs),
        "engine": {
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "block_size": config.cache.block_size,
            "enable_prefix_caching": config.cache.enable_prefix_caching,
            "attention_backend": config.model.attention_backend,
            "max_model_len": config.model.max_model_len,
        },
    }
    return result, token_ids


def _pagellm_generate(llm: LLM, requests: list[BenchRequest]) -> tuple[float, list]:
    """Seconds of one greedy `generate` call over all `requests`, and its outputs."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def _run_hf(model_path: str, requests: list[BenchRequest], warmup: list[BenchRequest],
            batch_size: int, dtype: str) -> tuple[dict[str, Any], list[list[int]]]:
    """HF's load time, timings and results, and its output token ids per request."""
    import torch

    from benchmarks.hf_baseline import load_hf_model, run_hf_generate

    model, load_s = load_hf_model(model_path, "cpu", getattr(torch, dtype))
    run_hf_generate(model, warmup, len(warmup))
    run = run_hf_generate(model, requests, batch_size)
    return {
        "load_s": load_s,
        "elapsed_s": run.elapsed_s,
        "num_requests": run.num_requests,
        "batch_size": run.batch_size,
        "output_tokens": run.output_tokens,
        "generated_tokens": run.generated_tokens,
        "output_tokens_per_s": run.output_tokens_per_s,
    }, run.output_token_ids


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    """How often greedy outputs match HF's: a sanity check that the fast system computes the same thing.

    Exact equality is not expected everywhere: float32 sums in a different order (padding, batch
    shape) can flip a near-tie, and HF masks EOS where pagellm only ignores it.
    """
    identical = sum(a == b for a, b in zip(ours, theirs))
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(ours, theirs)]
    return {
        "identical_requests": identical,
        "num_requests": len(ours),
        "mean_matching_prefix_tokens": sum(prefix) / len(prefix),
    }


def _summary(payload: dict[str, Any]) -> str:
    results = payload["results"]
    rows = []
    for name, key in (("pagellm", "pagellm"), ("hf generate", "hf")):
        if key in results:
            r = results[key]
            ratio = r.get("ratio_vs_hf")
            rows.append([name, r["num_requests"], r["output_tokens"], r["elapsed_s"], r["output_tokens_per_s"],
                         "-" if ratio is None else f"{ratio:.2f}x"])
    table = format_table(["system", "requests", "output tokens", "seconds", "output tok/s", "ratio vs HF"], rows)
    lines = [table, "", f"pagellm start-up to ready: {results['pagellm']['startup_s']:.2f} s"]
    if "hf" in results:
        agreement = results["greedy_agreement"]
        lines.append(f"HF model load: {results['hf']['load_s']:.2f} s")
        lines.append(f"greedy outputs identical to HF: {agreement['identical_requests']}/{agreement['num_requests']} "
                     f"(mean matching prefix {agreement['mean_matching_prefix_tokens']:.1f} tokens)")
    hw = payload["hardware"]
    lines.append(f"{hw['cpu_model']}, {hw['usable_cores']} cores, torch threads {hw['torch_threads']}")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory; default: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and activations for both systems (pagellm's auto picks bfloat16 on CPUs with bf16 instructions)")
    parser.add_argument("--hf-dtype", choices=("float32", "bfloat16"), default=None,
                        help="HF's dtype when it should differ from --dtype (e.g. each system's own default)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    parser.add_argument("--min-input-len", type=int, default=32)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts (and of the engine)")
    parser.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of HF generate")
    parser.add_argument("--skip-hf", action="store_true", help="run pagellm only")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="pagellm's step token budget; default: the engine's")
    parser.add_argument("--output-json", default=None, help="result path; default: benchmarks/results/offline_cpu_<UTC time>.json")
    parser.add_argument("--no-save", action="store_true", help="print the table only")
    args = parser.parse_args(argv)
    for name in ("num_prompts", "output_len", "min_input_len", "max_input_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer")
    if args.max_input_len < args.min_input_len:
        parser.error("--max-input-len must be >= --min-input-len")
    return args


if __name__ == "__main__":
    main()
