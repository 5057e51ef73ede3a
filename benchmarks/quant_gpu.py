"""Quantized weights on one GPU: kernel correctness and speed per layer shape, then the engine per
method in the same run (Llama-3.1-8B shapes, dummy weights quantized at load).

Phases (each optional, `--phases`):
  kernels   per Llama-8B projection shape and row count M: bf16 `F.linear` (cuBLAS), the dequantizing
            Triton kernel on fp8 / int8 / int4 weights (16-bit activations), and the W8A8 paths
            (`torch._scaled_mm` fp8, `torch._int_mm` int8, per-token activation quantization
            included); time by CUDA-graph replay, error against float32 dequantize-then-matmul, and
            at M = 1 the fraction of copy bandwidth the weight read reaches
  batch1    each --methods engine: batch-1 decode tok/s (128 in / 128 out), KV blocks
  random    each --random-methods engine: random --num-prompts x --input-len/--output-len throughput
An engine is a --quantization method, with "+kv8" for --kv-cache-dtype fp8 (e.g. none+kv8), and
"@cublas" for one-row steps of dense weights kept on cuBLAS (else timed against the one-row kernel).

On the GPU machine, from the repository root:
    python3 -m benchmarks.quant_gpu --out-dir "$OUT" --commit SHA
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from pagellm import LLM
from pagellm.benchmarks.datasets import random_requests
from pagellm.benchmarks.latency import measure_latency
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import measure_ceilings
from pagellm.benchmarks.runner import engine_summary
from pagellm.benchmarks.throughput import measure_throughput
from pagellm.quantization.int4 import dequantize, pack_pairs, quantize_rtn
from pagellm.ops.triton import dense_one_row
from pagellm.ops.triton.one_row_tiles import timing_one_row_products
from pagellm.ops.triton.matmul import dequant_matmul
from pagellm.quantization.w8a8 import quantize_per_row, w8a8_matmul

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
"""Llama-3.1-8B projections: (N, K)."""


def bench_us(fn) -> float:
    """Microseconds of `fn` by CUDA-graph replay, compiled, autotuned and its one-row tiles chosen
    first (as at an engine's start-up)."""
    import triton.testing

    with timing_one_row_products():
        fn()  # compile / autotune / choose tiles outside the graph
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=50)


def quantized_layouts(w: torch.Tensor) -> dict[str, dict[str, Any]]:
    """A float32 weight [N, K] per method: its `dequant_matmul` arguments, the float32 weight they
    hold (`ref`) and their bytes."""
    n, k = w.shape
    fp8, fp8_scale = quantize_per_row(w, torch.float8_e4m3fn)
    int8, int8_scale = quantize_per_row(w, torch.int8)
    q4, s4, z4 = quantize_rtn(w, 128)
    q4, s4 = pack_pairs(q4), s4.half()
    return {
        "fp8": dict(weight=fp8, scale=fp8_scale, zero=0, group=0, ref=fp8.float() * fp8_scale[:, None],
                    bytes=n * k),
        "int8": dict(weight=int8, scale=int8_scale, zero=0, group=0, ref=int8.float() * int8_scale[:, None],
                     bytes=n * k),
        "int4_g128": dict(weight=q4, scale=s4, zero=z4, group=128, ref=dequantize(q4, s4, z4, 128),
                          bytes=n * k // 2 + n * k // 64),
    }


def kernel_phase(rows_list: list[int]) -> list[dict[str, Any]]:
    records = []
    for name, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=gen, dtype=torch.float32) * 0.02
        w16 = w.bfloat16()
        fp8, int8, int4 = quantized_layouts(w).values()
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
            xf = x.float()
            def product(c: dict[str, Any], x: torch.Tensor = x):
                return lambda: dequant_matmul(x, c["weight"], c["scale"], c["zero"], c["group"])

            cases = {
                "bf16": (lambda: F.linear(x, w16), xf @ w16.float().t(), 2 * n * k),
                "fp8_w8a16": (product(fp8), xf @ fp8["ref"].t(), fp8["bytes"]),
                "int8_w8a16": (product(int8), xf @ int8["ref"].t(), int8["bytes"]),
                "int4_g128": (product(int4), xf @ int4["ref"].t(), int4["bytes"]),
                "fp8_w8a8": (lambda: w8a8_matmul(x, fp8["weight"], fp8["scale"]), None, n * k),
            }
            if rows == 1:  # the one-row kernel on the dense weight (the engine times it against cuBLAS)
                cases["bf16_gemv"] = (lambda: dense_one_row.dense_gemv(x, w16), xf @ w16.float().t(), 2 * n * k)
            if rows > 16:
                cases["int8_w8a8"] = (lambda: w8a8_matmul(x, int8["weight"], int8["scale"]), None, n * k)
            for method, (fn, ref, weight_bytes) in cases.items():
                record = {"layer": name, "n": n, "k": k, "rows": rows, "method": method, "weight_bytes": weight_bytes}
                try:
                    record["us"] = bench_us(fn)
                    if ref is not None:
                        out = fn().float()
                        record["max_rel_error"] = ((out - ref).abs().max() / ref.abs().max()).item()
                except Exception as e:  # noqa: BLE001 (recorded, the other cases still run)
                    record["error"] = f"{type(e).__name__}: {e}"[:300]
                records.append(record)
            print(f"{name} M={rows}: " + ", ".join(f"{r['method']} {r.get('us', float('nan')):.1f}us"
                                                  for r in records if r["layer"] == name and r["rows"] == rows),
                  flush=True)
    return records


def engine_phase(args: argparse.Namespace, method: str, random_run: bool, deadline: float) -> dict[str, Any]:
    start = time.perf_counter()
    method_kv, _, cublas = method.partition("@")  # "none@cublas": one-row dense steps kept on cuBLAS
    chosen = dense_one_row.dense_gemv_is_faster
    dense_one_row.dense_gemv_is_faster = (lambda x, w: False) if cublas else chosen
    try:
        return _engine_run(args, method, method_kv, random_run, deadline, start)
    finally:
        dense_one_row.dense_gemv_is_faster = chosen


def _engine_run(args: argparse.Namespace, method: str, method_kv: str, random_run: bool, deadline: float,
                start: float) -> dict[str, Any]:
    quantization, _, kv = method_kv.partition("+")
    llm = LLM(args.model, load_format="dummy", quantization=quantization, max_num_seqs=args.max_num_seqs,
              kv_cache_dtype="fp8" if kv == "kv8" else "auto")
    config = llm.llm_engine.config
    result: dict[str, Any] = {"method": method, "startup_s": time.perf_counter() - start, **engine_summary(llm),
                              "gpu_memory_allocated_gib": torch.cuda.memory_allocated() / 2**30}
    if "batch1" in args.phases:
        latency = measure_latency(llm, 1, 128, 128, 3, 1, 0)
        result["batch1_tok_s"] = 1.0 / latency["time_per_output_token_s"]["mean"]
        print(f"{method}: batch-1 {result['batch1_tok_s']:.1f} tok/s", flush=True)
    if random_run:
        requests = random_requests(args.num_prompts, args.input_len, args.output_len, config.model.source.arch.vocab_size, 0)
        numbers, _ = measure_throughput(llm, requests, deadline)
        result["random"] = numbers
        print(f"{method}: random {numbers.get('output_tokens_per_s')} out tok/s", flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--phases", nargs="+", default=["kernels", "batch1", "random"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 17, 64, 256, 1024, 4096])
    p.add_argument("--methods", nargs="+", default=["none", "fp8", "int8", "rtn"])
    p.add_argument("--random-methods", nargs="+", default=["none", "fp8", "none+kv8"])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--random-cap-s", type=float, default=170, help="seconds each random run may take")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    payload: dict[str, Any] = {"metadata": run_metadata(args.commit), "args": vars(args)}
    payload["ceilings"] = measure_ceilings(torch.device("cuda"), 1 << 30, 8192, torch.bfloat16)[1]
    out = Path(args.out_dir) / "quant_gpu.json" if args.out_dir else default_result_path("quant_gpu")
    if "kernels" in args.phases:
        payload["kernels"] = kernel_phase(args.rows)
        write_json(payload, out)  # each result kept as soon as it exists
    engines = payload["engines"] = []
    batch1 = "batch1" in args.phases
    methods = list(dict.fromkeys([*args.methods, *args.random_methods])) if batch1 else args.random_methods
    for method in methods if {"batch1", "random"} & set(args.phases) else []:
        random_run = "random" in args.phases and method in args.random_methods
        try:
            engines.append(engine_phase(args, method, random_run, time.perf_counter() + args.random_cap_s))
        except Exception as e:  # noqa: BLE001
            engines.append({"method": method, "error": f"{type(e).__name__}: {e}"[:500]})
            print(engines[-1], flush=True)
        write_json(payload, out)
    print(summary(payload))
    write_json(payload, out)
    return payload


def summary(payload: dict[str, Any]) -> str:
    lines = []
    bandwidth = (payload.get("ceilings") or {}).get("copy_bytes_per_s")
    kernels = payload.get("kernels") or []
    if kernels:
        rows = []
        for r in kernels:
            if "us" not in r:
                rows.append([r["layer"], r["rows"], r["method"], r.get("error", "")[:40], "", ""])
                continue
            base = next((b["us"] for b in kernels if b["layer"] == r["layer"] and b["rows"] == r["rows"]
                         and b["method"] == "bf16" and "us" in b), None)
            frac = f"{r['weight_bytes'] / (r['us'] * 1e-6) / bandwidth:.2f}" if bandwidth and r["rows"] == 1 else ""
            rows.append([r["layer"], r["rows"], r["method"], f"{r['us']:.1f}",
                         f"{base / r['us']:.2f}x" if base else "", frac])
        lines.append(format_table(["layer", "M", "method", "us", "vs bf16", "of copy bw (M=1)"], rows, left=[0, 2]))
    engines = [e for e in payload.get("engines", []) if "error" not in e]
    if engines:
        base = next((e for e in engines if e["method"] == "none"), None)
        rows = []
        for e in engines:
            rnd = (e.get("random") or {}).get("output_tokens_per_s")
            brnd = (base.get("random") or {}).get("output_tokens_per_s") if base else None
            b1, base_b1 = e.get("batch1_tok_s"), base.get("batch1_tok_s") if base else None
            rows.append([e["method"], f"{b1:.1f}" if b1 else "", f"{b1 / base_b1:.2f}x" if b1 and base_b1 else "",
                         f"{rnd:.0f}" if rnd else "", f"{rnd / brnd:.2f}x" if rnd and brnd else "",
                         e.get("num_kv_blocks")])
        lines.append(format_table(["method", "batch-1 tok/s", "vs bf16", "random out tok/s", "vs bf16", "KV blocks"],
                                  rows, left=[0]))
    return "\n\n".join(lines)


if __name__ == "__main__":
    main()
