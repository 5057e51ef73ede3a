"""One GPU, the fast path: kernel tests, measured ceilings, pagellm and HF `generate` on the same prompts,
each result as a fraction of its physical floor.

Phases, in order (each capped in time; a failure is recorded and the rest still run):
  ceilings        device-to-device copy bandwidth and a large matmul's rate (pagellm/benchmarks/roofline.py)
  kernel_tests    pytest on the GPU kernel test files, pass/fail counts
  datasets.*      random prompts; ShareGPT prompts from --sharegpt-requests (the dataset package is too
                  large to travel to the GPU machine, so the sampled requests are written here first)
  backend_check   greedy tokens and logprobs of --check-backend against the torch backend, same weights
  engine.*        pagellm with the engine's defaults for the device (on CUDA: Triton attention and CUDA
                  graphs): load, sampling features, batch-1 decode, random throughput, ShareGPT throughput
  hf.*            HF `generate` with its largest batch that fits, on the first --hf-requests requests of
                  the same ShareGPT and random sets, and batch-1 decode
Floors: bytes over the measured copy bandwidth and FLOPs over the measured matmul rate, for exactly
the work each run did; `fraction_of_floor` = floor time / achieved time.

On the GPU machine, from the repository root:
    python3 -m benchmarks.gpu_fast_path --out-dir "$OUT" --commit SHA   # SHA: the commit sent (no .git there)
The ShareGPT requests file (default: benchmarks/data/sharegpt_1000_seed0.json.gz) is made with:
    .venv/bin/python -m benchmarks.gpu_fast_path --write-sharegpt-requests PATH
Every phase's code path on the CPU, tiny sizes:
    .venv/bin/python -m benchmarks.gpu_fast_path --smoke --model DIR --device cpu --dtype float32 ...
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.hf_baseline import load_hf_like, run_hf_generate, run_hf_largest_batch
from benchmarks.phases import PhaseRunner
from pagellm import LLM, SamplingParams
from pagellm.benchmarks.datasets import BenchRequest, dataset_requests, load_requests, random_requests, save_requests
from pagellm.benchmarks.latency import measure_latency
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import (ModelCost, decode_floor, measure_ceilings, run_floor, serial_floor,
                                       with_fraction)
from pagellm.benchmarks.runner import engine_summary
from pagellm.benchmarks.throughput import measure_throughput
from pagellm.config import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.loader import resolve_model

DEFAULT_SHAREGPT_REQUESTS = str(Path(__file__).resolve().parent / "data" / "sharegpt_1000_seed0.json.gz")
DEFAULT_CAPS = {
    "ceilings": 20, "kernel_tests": 240, "datasets.random": 20, "datasets.sharegpt": 20, "backend_check": 45,
    "engine.load": 45, "engine.sampling_features": 20, "engine.batch1_decode": 40, "engine.random": 130,
    "engine.sharegpt": 60, "hf.load": 30, "hf.sharegpt": 110, "hf.random": 100, "hf.batch1_decode": 20,
}
"""Seconds per phase; together more than the default budget, which clips the last ones if earlier ones run long."""
_SMOKE = {"num_prompts": 4, "input_len": 32, "output_len": 8, "sharegpt_prompts": 4, "hf_requests": 2,
          "batch1_input_len": 16, "batch1_output_len": 6, "check_prompt_lens": [5, 40], "check_tokens": 4,
          "copy_bytes": 1 << 20, "matmul_size": 128, "ceiling_iters": 3}
_LATENCY_ITERS = 3
_CHECK_KV_BYTES = 1 << 30


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = _parse_args(argv)
    if args.write_sharegpt_requests:
        source = resolve_model(args.model, args.load_format)
        requests, info = dataset_requests("sharegpt", args.sharegpt_prompts, source, args.seed, 0, None,
                                          path=args.dataset_path)
        save_requests(args.write_sharegpt_requests, requests, {**info, "for_model": args.model})
        print(f"wrote {len(requests)} requests to {args.write_sharegpt_requests}: {info['tokenizer']}")
        return None
    config = EngineArgs.from_cli_args(args).create_engine_config()
    metadata = run_metadata(args.commit)
    runner = PhaseRunner(args.time_budget_s, {**DEFAULT_CAPS, **dict(args.cap)})
    ctx = SimpleNamespace(config=config, cost=ModelCost.from_arch(config.model.source.arch, config.model.dtype.itemsize),
                          ceilings=None, random=None, sharegpt=None)

    def ceilings(deadline: float) -> dict[str, Any]:
        ctx.ceilings, record = measure_ceilings(config.device, args.copy_bytes, args.matmul_size, config.model.dtype,
                                                args.ceiling_iters)
        return record

    runner.run("ceilings", ceilings)
    runner.run("kernel_tests", lambda deadline: run_kernel_tests(args.kernel_tests, deadline))
    runner.run("datasets.random", lambda deadline: _random_set(args, ctx))
    runner.run("datasets.sharegpt", lambda deadline: _sharegpt_set(args, ctx))
    runner.run("backend_check", lambda deadline: backend_check(args, config))
    memory = {"after_backend_check": _free_memory()}
    _engine_phases(runner, args, ctx)
    memory["after_engine"] = _free_memory()
    if not args.skip_hf:
        _hf_phases(runner, args, ctx)
        memory["after_hf"] = _free_memory()

    payload = {"benchmark": "gpu_fast_path", **metadata, "parameters": vars(args),
               "model_cost": dataclasses.asdict(ctx.cost), "phases": runner.records,
               "ratios_vs_hf": _ratios(runner.records), "gpu_memory_allocated_bytes": memory,
               "notes": {"hf_subset": f"HF ran on the first {args.hf_requests} requests of the same ShareGPT and "
                                      "random sets (same prompts and lengths); pagellm ran on all of them. Each ratio "
                                      "is pagellm's output tokens/s over HF's, not the same total work.",
                         "floors": "fraction_of_floor = floor time / achieved time; floors from bytes over the "
                                   "measured copy bandwidth and FLOPs over the measured matmul rate "
                                   "(pagellm/benchmarks/roofline.py)"}}
    path = default_result_path("gpu_fast_path")
    paths = [] if args.no_save else [write_json(payload, path)]
    if args.out_dir:
        paths.append(write_json(payload, Path(args.out_dir) / path.name))
    print("wrote", ", ".join(map(str, paths)))
    print(summary_table(payload))
    return payload


def run_kernel_tests(paths: list[str], deadline: float) -> dict[str, Any]:
    """pytest on the test files that exist, in a child process stopped at the deadline; counts from JUnit XML."""
    present = [p for p in paths if os.path.exists(p)]
    result: dict[str, Any] = {"paths": present, "missing": [p for p in paths if p not in present]}
    if not present:
        return {**result, "ran": False}
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *present]
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=max(1.0, deadline - time.perf_counter()))
        suites = ET.parse(xml).getroot().iter("testsuite")
        counts = {k: 0 for k in ("tests", "failures", "errors", "skipped")}
        failed = []
        for suite in suites:
            for k in counts:
                counts[k] += int(suite.get(k, 0))
            failed += [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                       if case.find("failure") is not None or case.find("error") is not None]
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**result, "ran": True, "exit_code": done.returncode, "passed": passed, "failed": counts["failures"],
            "errors": counts["errors"], "skipped": counts["skipped"], "failed_tests": failed[:20],
            "output_tail": done.stdout.strip().splitlines()[-5:]}


def backend_check(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    """The same prompts through the torch backend (the oracle) and --check-backend, same dummy weights:
    greedy tokens, and logprobs of the prompt tokens (teacher-forced, so they never diverge) and of
    the generated tokens over the common prefix."""
    vocab = config.model.source.arch.vocab_size
    prompts = [{"prompt_token_ids": random_requests(1, n, 1, vocab, args.seed + n)[0].prompt_token_ids}
               for n in args.check_prompt_lens]
    params = SamplingParams(temperature=0.0, max_tokens=args.check_tokens, ignore_eos=True, logprobs=5,
                            prompt_logprobs=1)
    outputs = {}
    # A small KV cache: a few prompts need little, and the engines that follow must find the GPU free.
    kv_bytes = min(args.kv_cache_memory_bytes or _CHECK_KV_BYTES, _CHECK_KV_BYTES)
    for backend in ("torch", args.check_backend):
        llm = LLM(**{**dataclasses.asdict(EngineArgs.from_cli_args(args)), "attention_backend": backend,
                     "enable_prefix_caching": False, "kv_cache_memory_bytes": kv_bytes})
        outputs[backend] = (llm.llm_engine.config.model.attention_backend, llm.generate(prompts, params, use_tqdm=False))
        del llm
        _free_memory()
    (ref_name, ref), (name, got) = outputs["torch"], outputs[args.check_backend]
    identical, prefix, sample_diff, prompt_diff = 0, [], 0.0, 0.0
    for a, b in zip(ref, got):
        tokens_a, tokens_b = a.outputs[0].token_ids, b.outputs[0].token_ids
        identical += tokens_a == tokens_b
        common = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y), len(tokens_a))
        prefix.append(common)
        for i in range(common):
            token = tokens_a[i]
            sample_diff = max(sample_diff, abs(a.outputs[0].logprobs[i][token].logprob
                                               - b.outputs[0].logprobs[i][token].logprob))
        for token, la, lb in zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            prompt_diff = max(prompt_diff, abs(la[token].logprob - lb[token].logprob))
    return {"reference_backend": ref_name, "checked_backend": name, "prompt_lens": args.check_prompt_lens,
            "output_tokens": args.check_tokens, "identical_outputs": identical, "num_prompts": len(prompts),
            "matching_prefix_tokens": prefix, "max_abs_logprob_diff_generated": sample_diff,
            "max_abs_logprob_diff_prompt": prompt_diff}


def check_sampling_features(llm: LLM, prompts: list[dict], num_tokens: int) -> dict[str, Any]:
    """Every device-side sampling feature at once: the step must run and return what was asked."""
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={11: 5.0}, seed=3,
                            min_tokens=2, max_tokens=num_tokens, logprobs=5, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ok = all(len(o.outputs) == 2 and all(len(c.token_ids) == num_tokens == len(c.logprobs) for c in o.outputs)
             and len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
    forced = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={11: 100.0},
                                                      ignore_eos=True), use_tqdm=False)
    return {"all_outputs_complete": ok, "logit_bias_forces_token": forced[0].outputs[0].token_ids == [11] * 4}


def _random_set(args: argparse.Namespace, ctx: SimpleNamespace) -> dict[str, Any]:
    ctx.random, info = dataset_requests("random", args.num_prompts, ctx.config.model.source, args.seed, args.input_len,
                                        args.output_len)
    return info


def _sharegpt_set(args: argparse.Namespace, ctx: SimpleNamespace) -> dict[str, Any]:
    """From the requests file if there is one (its first N are what sampling N would give), else sampled here."""
    n = args.sharegpt_prompts
    if not args.sharegpt_requests:
        ctx.sharegpt, info = dataset_requests("sharegpt", n, ctx.config.model.source, args.seed, 0, None,
                                              path=args.dataset_path)
        return info
    requests, info = load_requests(args.sharegpt_requests)
    if len(requests) < n or info.get("seed") != args.seed:
        raise ValueError(f"{args.sharegpt_requests} holds {len(requests)} requests sampled with seed "
                         f"{info.get('seed')}; {n} with seed {args.seed} were asked for: write a new one with "
                         "--write-sharegpt-requests")
    ctx.sharegpt = requests[:n]
    return {**info, "num_requests": n, "total_prompt_tokens": sum(len(r.prompt_token_ids) for r in ctx.sharegpt),
            "total_output_tokens": sum(r.output_len for r in ctx.sharegpt)}


def _engine_phases(runner: PhaseRunner, args: argparse.Namespace, ctx: SimpleNamespace) -> None:
    """Load the engine once; after a phase that did not end well (a timeout can stop it mid-step and
    leave it inconsistent), load a fresh one before the next phase."""
    state: dict[str, Any] = {}

    def load(deadline: float, max_num_seqs: int) -> dict[str, Any]:
        start = time.perf_counter()
        state["llm"] = LLM(**{**dataclasses.asdict(EngineArgs.from_cli_args(args)), "max_num_seqs": max_num_seqs})
        state["max_num_seqs"] = max_num_seqs
        result = {"startup_s": time.perf_counter() - start, **engine_summary(state["llm"])}
        if ctx.config.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(ctx.config.device)
            result.update(gpu_memory_used_fraction=(total - free) / total, gpu_total_gib=total / 2**30)
        return result

    vocab = ctx.config.model.source.arch.vocab_size
    sampling_prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in random_requests(8, 64, 1, vocab, -2)]
    steps = [("sampling_features", lambda llm, deadline: check_sampling_features(llm, sampling_prompts,
                                                                                  args.check_tokens)),
             ("batch1_decode", lambda llm, deadline: _batch1_decode(llm, args, ctx))]
    steps += [(name, lambda llm, deadline, r=getattr(ctx, name): _engine_throughput(llm, r, deadline, ctx))
              for name in ("random", "sharegpt") if getattr(ctx, name) is not None]
    for i, (name, fn) in enumerate(steps):
        # A throughput phase may ask for its own max_num_seqs (the right concurrency depends on
        # how much KV its requests need): the engine is reloaded with it.
        max_num_seqs = getattr(args, f"{name}_max_num_seqs", None) or args.max_num_seqs
        if state.get("max_num_seqs") not in (None, max_num_seqs):
            state.clear()
            _free_memory()
        if "llm" not in state:
            runner.run("engine.load" if i == 0 else f"engine.reload_for_{name}",
                       lambda deadline, n=max_num_seqs: load(deadline, n))
            if "llm" not in state:
                break
        runner.run(f"engine.{name}", lambda deadline: fn(state["llm"], deadline))
        if not runner.ok(f"engine.{name}"):
            state.clear()
            _free_memory()
    state.clear()


def _batch1_decode(llm: LLM, args: argparse.Namespace, ctx: SimpleNamespace) -> dict[str, Any]:
    latency = measure_latency(llm, 1, args.batch1_input_len, args.batch1_output_len, _LATENCY_ITERS, 1, args.seed)
    tpot = latency["time_per_output_token_s"]["mean"]
    return {**latency, "output_tokens_per_s": 1.0 / tpot, "floor": _decode_floor(args, ctx, tpot)}


def _engine_throughput(llm: LLM, requests: list[BenchRequest], deadline: float, ctx: SimpleNamespace) -> dict:
    numbers, run = measure_throughput(llm, requests, deadline)
    work = [(t.prompt_tokens, t.output_tokens) for t in run.requests if t.output_tokens]
    config = llm.llm_engine.config
    if ctx.ceilings is None:
        numbers["floor"] = None
        return numbers
    limits = (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens)
    numbers["floor"] = with_fraction(run_floor(ctx.cost, ctx.ceilings, work, *limits), run.elapsed_s)
    serial = serial_floor(ctx.cost, ctx.ceilings, work, *limits)
    numbers["serial_floor"] = {**serial, "fraction_of_serial_floor": serial["serial_s"] / run.elapsed_s}
    return numbers


def _hf_phases(runner: PhaseRunner, args: argparse.Namespace, ctx: SimpleNamespace) -> None:
    state: dict[str, Any] = {}

    def load(deadline: float) -> dict[str, Any]:
        model, load_s = load_hf_like(ctx.config.model.source, ctx.config.device, ctx.config.model.dtype)
        run_hf_generate(model, [BenchRequest([1, 2, 3, 4], 2)] * 2, 2)  # warm-up: kernels, allocator
        state["model"] = model
        return {"load_s": load_s, "model_class": type(model).__name__, "dtype": str(ctx.config.model.dtype)}

    runner.run("hf.load", load)
    if "model" in state:
        model = state["model"]
        for name in ("sharegpt", "random"):
            requests = getattr(ctx, name)
            if requests is not None:
                runner.run(f"hf.{name}",
                           lambda deadline, r=requests[:args.hf_requests]: _hf_throughput(model, r, args, ctx))
        runner.run("hf.batch1_decode", lambda deadline: _hf_batch1_decode(model, args, ctx))
        del model
    state.clear()


def _hf_throughput(model: torch.nn.Module, requests: list[BenchRequest], args: argparse.Namespace,
                   ctx: SimpleNamespace) -> dict[str, Any]:
    run = run_hf_largest_batch(model, requests, args.hf_max_batch_size)
    work = [(len(r.prompt_token_ids), r.output_len) for r in requests]
    floor = None if ctx.ceilings is None else with_fraction(
        run_floor(ctx.cost, ctx.ceilings, work, run.batch_size), run.elapsed_s)
    return {**run.summary(), "requests_per_s": len(requests) / run.elapsed_s, "floor": floor}


def _hf_batch1_decode(model: torch.nn.Module, args: argparse.Namespace, ctx: SimpleNamespace) -> dict[str, Any]:
    """Seconds per decoded token: (time of N new tokens - time of 1) / (N - 1), best of two each."""
    n = args.batch1_output_len
    request = random_requests(1, args.batch1_input_len, n, ctx.config.model.source.arch.vocab_size, args.seed + 1)[0]
    first = min(run_hf_generate(model, [request._replace(output_len=1)], 1).elapsed_s for _ in range(2))
    full = min(run_hf_generate(model, [request], 1).elapsed_s for _ in range(2))
    per_token = (full - first) / (n - 1)
    return {"time_per_output_token_s": per_token, "output_tokens_per_s": 1.0 / per_token,
            "input_len": args.batch1_input_len, "output_len": n, "floor": _decode_floor(args, ctx, per_token)}


def _decode_floor(args: argparse.Namespace, ctx: SimpleNamespace, per_token_s: float) -> dict | None:
    """Batch-1 decode floor at the run's mean context length."""
    if ctx.ceilings is None:
        return None
    context = args.batch1_input_len + args.batch1_output_len // 2
    return {**with_fraction(decode_floor(ctx.cost, ctx.ceilings, context), per_token_s), "context_len": context}


def _ratios(records: dict[str, dict]) -> dict[str, float]:
    ratios = {}
    for name in ("batch1_decode", "sharegpt", "random"):
        ours, theirs = records.get(f"engine.{name}", {}), records.get(f"hf.{name}", {})
        if ours.get("status") == "ok" and theirs.get("status") == "ok":
            ratios[name] = ours["result"]["output_tokens_per_s"] / theirs["result"]["output_tokens_per_s"]
    return ratios


def summary_table(payload: dict[str, Any]) -> str:
    """One row per measurement: value, its ceiling (from the floor), fraction of that ceiling, ratio vs HF."""
    records, ratios = payload["phases"], payload["ratios_vs_hf"]
    rows = []
    ceil = records.get("ceilings", {})
    if ceil.get("status") == "ok":
        c = ceil["result"]
        rows.append(["copy bandwidth (read + write)", f"{c['copy_bytes_per_s'] / 1e9:.4g} GB/s", "-", "-", "-"])
        rows.append([f"matmul {c['matmul_shape'][0]}^3 {c['matmul_dtype']}",
                     f"{c['matmul_flops_per_s'] / 1e12:.4g} TFLOP/s", "-", "-", "-"])
    tests = records.get("kernel_tests", {}).get("result")
    if tests and tests["ran"]:
        rows.append(["kernel tests", f"{tests['passed']} passed, {tests['failed'] + tests['errors']} failed", "-", "-",
                     "-"])
    check = records.get("backend_check", {}).get("result")
    if check:
        rows.append([f"{check['checked_backend']} vs {check['reference_backend']}",
                     f"{check['identical_outputs']}/{check['num_prompts']} same tokens, "
                     f"max |dlogprob| {check['max_abs_logprob_diff_prompt']:.3f}", "-", "-", "-"])
    for system in ("engine", "hf"):
        for name in ("batch1_decode", "random", "sharegpt"):
            record = records.get(f"{system}.{name}")
            if record is None:
                continue
            label = f"{'pagellm' if system == 'engine' else 'hf'} {name}"
            if record["status"] != "ok":
                rows.append([label, record["status"], "-", "-", "-"])
                continue
            r = record["result"]
            floor = r.get("floor")
            ceiling = "-" if floor is None else f"{r['output_tokens_per_s'] / floor['fraction_of_floor']:.0f}"
            fraction = "-" if floor is None else f"{floor['fraction_of_floor']:.2f}"
            ratio = f"{ratios[name]:.2f}x" if system == "engine" and name in ratios else "-"
            partial = "" if r.get("complete", True) else " (partial)"
            rows.append([label, f"{r['output_tokens_per_s']:.1f} out tok/s{partial}", ceiling, fraction, ratio])
    failed = [n for n, r in records.items() if r["status"] != "ok"]
    table = format_table(["measurement", "value", "ceiling tok/s", "fraction of floor", "pagellm / HF"], rows)
    return table + (f"\nnot ok: {', '.join(failed)}" if failed else "")


def _free_memory() -> int | None:
    """Collect garbage and return cached GPU memory; the bytes torch still holds (None without CUDA),
    which should be ~0 between phases."""
    gc.collect()
    if not torch.cuda.is_available():
        return None
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _cap(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in DEFAULT_CAPS or not seconds:
        raise argparse.ArgumentTypeError(f"expected PHASE=SECONDS with PHASE one of {', '.join(DEFAULT_CAPS)}")
    return name, float(seconds)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct", help="model path or dummy preset")
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes, for the CPU: {_SMOKE}")
    p.add_argument("--num-prompts", type=int, default=1000, help="random requests for pagellm")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--sharegpt-prompts", type=int, default=1000)
    p.add_argument("--random-max-num-seqs", type=int, default=None,
                   help="engine max_num_seqs for the random run (default: --max-num-seqs)")
    p.add_argument("--sharegpt-max-num-seqs", type=int, default=None,
                   help="engine max_num_seqs for the ShareGPT run (default: --max-num-seqs)")
    p.add_argument("--sharegpt-requests", default=DEFAULT_SHAREGPT_REQUESTS,
                   help="requests file from --write-sharegpt-requests; '' samples ShareGPT here")
    p.add_argument("--dataset-path", default=None, help="ShareGPT JSON to sample from; default: the package's")
    p.add_argument("--write-sharegpt-requests", default=None, metavar="PATH",
                   help="only sample --sharegpt-prompts ShareGPT requests for --model, write them to PATH (.gz: "
                        "gzipped), and exit")
    p.add_argument("--batch1-input-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--check-backend", default="triton", help="backend compared against torch in backend_check")
    p.add_argument("--check-prompt-lens", type=int, nargs="+", default=[17, 300, 1000])
    p.add_argument("--check-tokens", type=int, default=32,
                   help="tokens per sequence in the backend and sampling checks")
    p.add_argument("--hf-requests", type=int, default=64, help="HF runs the first K requests of each set")
    p.add_argument("--hf-max-batch-size", type=int, default=64, help="HF's first batch size, halved on OOM")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--kernel-tests", nargs="*", default=["tests/test_attention_triton.py", "tests/test_fused_ops.py"])
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help="copy-bandwidth buffer size")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--ceiling-iters", type=int, default=20)
    p.add_argument("--time-budget-s", type=float, default=540.0, help="all phases together")
    p.add_argument("--cap", type=_cap, action="append", default=[], metavar="PHASE=SECONDS",
                   help=f"override a phase's cap; defaults: {DEFAULT_CAPS}")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--no-save", action="store_true", help="write the JSON only to --out-dir, not benchmarks/results/")
    p.add_argument("--commit", default=os.environ.get("PAGELLM_COMMIT"),
                   help="commit of the code, for a copy without git history (default: $PAGELLM_COMMIT)")
    EngineArgs.add_cli_args(p)
    p.set_defaults(load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=4096)
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**_SMOKE)
    args = p.parse_args(argv)
    if args.batch1_output_len < 2:
        p.error("--batch1-output-len must be >= 2")
    return args


if __name__ == "__main__":
    main()
