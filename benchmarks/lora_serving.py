"""Multi-LoRA against the base model, in the same run: offline throughput of random requests spread
evenly over N adapters, and batch-1 decode with one adapter, as ratios to the same numbers of an
engine without adapters.

The adapters are random PEFT folders (every projection of every layer, rank R) written for the
model's shapes, so that dummy weights with real shapes (`--load-format dummy`, a preset name such as
meta-llama/Llama-3.1-8B-Instruct) measure speed without a download:

    python -m benchmarks.lora_serving --out-dir "$OUT" --commit SHA            # a GPU
    python -m benchmarks.lora_serving --model '' --load-format auto --smoke     # the CPU, SmolLM2

Prints a table and writes JSON under benchmarks/results/ (hardware, date, command, commit).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagellm import LLM, EngineArgs, LoRARequest
from pagellm.benchmarks.datasets import random_requests
from pagellm.benchmarks.latency import measure_latency
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.throughput import measure_throughput
from pagellm.config.arch import ModelArchConfig
from pagellm.lora.adapter import module_shapes

_SMOKE = {"num_prompts": 8, "input_len": 32, "output_len": 16, "batch1_input_len": 16, "batch1_output_len": 32,
          "num_adapters": 2}


def write_adapters(arch: ModelArchConfig, folder: Path, count: int, rank: int, seed: int) -> list[LoRARequest]:
    """`count` random PEFT adapters of `rank` on every projection of every layer."""
    shapes = module_shapes(arch)
    requests = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(arch.num_hidden_layers):
            for name, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
        path = folder / f"adapter{i}_r{rank}"
        path.mkdir()
        save_file(tensors, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(shapes)}))
        requests.append(LoRARequest(f"adapter{i}_r{rank}", len(requests) + 1 + 1000 * rank, str(path)))
    return requests


def measure(llm: LLM, args: argparse.Namespace, loras: list[LoRARequest] | None) -> dict[str, Any]:
    """Batch-1 decode (the first adapter) and throughput (requests round-robin over the adapters)."""
    vocab = llm.llm_engine.config.model.source.arch.vocab_size
    latency = measure_latency(llm, 1, args.batch1_input_len, args.batch1_output_len, 3, 1, args.seed,
                              lora_request=loras[0] if loras else None)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    spread = [loras[i % len(loras)] for i in range(len(requests))] if loras else None
    numbers, _ = measure_throughput(llm, requests, lora_requests=spread)
    return {"batch1_output_tokens_per_s": 1.0 / latency["time_per_output_token_s"]["mean"],
            "batch1": latency, "throughput": numbers}


def measure_engine(args: argparse.Namespace, engine_args: dict[str, Any], rank: int | None) -> dict[str, Any]:
    """`measure` on an engine without adapters (rank None) or with `args.num_adapters` of `rank`."""
    if rank is None:
        return measure(LLM(**engine_args), args, None)
    arch = EngineArgs(**engine_args).create_engine_config().model.source.arch
    with tempfile.TemporaryDirectory() as tmp:
        loras = write_adapters(arch, Path(tmp), args.num_adapters, rank, args.seed)
        llm = LLM(**engine_args, enable_lora=True, max_loras=args.num_adapters, max_lora_rank=rank,
                  max_cpu_loras=args.num_adapters)
        return measure(llm, args, loras)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.smoke:
        for key, value in _SMOKE.items():
            setattr(args, key, value)
    engine_args = dict(model=args.model or None, load_format=args.load_format, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.input_len + args.output_len + 64, seed=args.seed)
    if args.device is not None:
        engine_args["device"] = args.device
    results: dict[str, Any] = {}
    # Each engine in a process of its own, so the next one finds the accelerator's memory free and
    # neither inherits the other's caches.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
        results["base"] = pool.submit(measure_engine, args, engine_args, None).result()
        for rank in args.ranks:
            results[f"lora_r{rank}"] = pool.submit(measure_engine, args, engine_args, rank).result()
    payload = {"benchmark": "lora_serving", **run_metadata(args.commit),
               "parameters": {k: v for k, v in vars(args).items() if k not in ("out_dir", "commit")},
               "results": results, "ratios": _ratios(results)}
    print(_table(payload))
    if not args.smoke:
        write_json(payload, default_result_path("lora_serving"))
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / default_result_path("lora_serving").name)
    return payload


def _ratios(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    base = results["base"]
    return {name: {"batch1_decode": r["batch1_output_tokens_per_s"] / base["batch1_output_tokens_per_s"],
                   "throughput": r["throughput"]["total_tokens_per_s"] / base["throughput"]["total_tokens_per_s"]}
            for name, r in results.items() if name != "base"}


def _table(payload: dict[str, Any]) -> str:
    rows = []
    for name, r in payload["results"].items():
        ratio = payload["ratios"].get(name, {"batch1_decode": 1.0, "throughput": 1.0})
        rows.append([name, f"{r['batch1_output_tokens_per_s']:.1f}", f"{ratio['batch1_decode']:.3f}",
                     f"{r['throughput']['total_tokens_per_s']:.0f}", f"{ratio['throughput']:.3f}"])
    header = ["engine", "batch-1 tok/s", "x base", "throughput tok/s", "x base"]
    return format_table(header, rows, left=[0])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct",
                   help="model path or dummy preset; '': SmolLM2")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default=None)
    p.add_argument("--num-adapters", type=int, default=8)
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch1-input-len", type=int, default=128)
    p.add_argument("--batch1-output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes: {_SMOKE}")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--commit", default=None, help="the code's commit, for a copy without git history")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
