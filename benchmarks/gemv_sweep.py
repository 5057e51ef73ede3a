"""Tile choices of the quantized kernels on one GPU, at Llama-3.1-8B layer shapes (dummy weights).

Phases (each optional, `--phases`):
  gemv   the one-row kernel (decode at batch 1) for fp8 / int8 per-channel and int4 groups of 128
         with zero points: every (BLOCK_N, BLOCK_K, warps, stages) of a grid, timed by CUDA-graph
         replay, as a fraction of the copy bandwidth; the engine's choice (`one_row_tiles`) and bf16 `F.linear`
         beside them. The fastest tiles are what `triton_matmul._gemv_configs` should hold.
  one_row  as the engine times them (`one_row_tiles`: each candidate over uncached copies of the
         weight): every tile of a grid of the one-row kernel, for int4 groups of 128 with zero
         points and bf16 activations (float16 products, or float32 with --float32-products) and for
         fp8 per channel, each checked against float64.
  large  many rows: the tiled kernel (dequantizing in registers) against dequantizing the whole
         weight once and multiplying with cuBLAS (`triton_matmul.DEQUANTIZE_ROWS` picks between
         them), for int4 groups of 128 and GGUF-like grouped layouts, against bf16.

On the GPU machine, from the repository root:
    python3 -m benchmarks.gemv_sweep --out-dir "$OUT" --commit SHA
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
import triton

from benchmarks.quant_gpu import SHAPES, bench_us, quantized_layouts
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import measure_ceilings
from pagellm.ops.triton import matmul as triton_matmul

DEVICE = "cuda"


def _launch(case: dict[str, Any], x: torch.Tensor, out: torch.Tensor, n: int, k: int, cfg: tuple):
    block_n, block_k, warps, stages = cfg
    weight, scale, zero, group = case["weight"], case["scale"], case["zero"], case["group"]
    packed = weight.dtype == torch.uint8
    if packed:  # eight 4-bit codes an int32 word, as triton_matmul._gemv passes them
        weight = weight.view(torch.int32)
    zero_arg, zero_const = triton_matmul._zero_args(zero, scale)

    def run() -> None:
        triton_matmul._gemv_kernel[(triton.cdiv(n, block_n),)](
            x, weight, scale, zero_arg, scale, out, n, k, weight.stride(0), scale.stride(0), zero_arg.stride(0),
            GROUP=group, PACKED=packed, ZERO=zero_const, OFFSET=False, PER_GROUP=group > 0,
            BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return run


def gemv_phase(args: argparse.Namespace, bandwidth: float) -> list[dict[str, Any]]:
    records = []
    grid8 = list(itertools.product(args.block_n, args.block_k, args.warps, args.stages))
    grid4 = list(itertools.product(args.int4_block_n, args.int4_block_k, args.warps, args.stages))
    for layer, (n, k) in SHAPES.items():
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        x = torch.randn(1, k, device=DEVICE, generator=gen).bfloat16()
        w16 = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).bfloat16()
        base = bench_us(lambda: F.linear(x, w16))
        records.append({"layer": layer, "method": "bf16", "config": "cuBLAS", "us": base,
                        "bw_fraction": 2 * n * k / (base * 1e-6) / bandwidth})
        w = torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
        for method, case in quantized_layouts(w).items():
            expected = x.float() @ case["ref"].t()
            tuned = bench_us(lambda: triton_matmul.dequant_matmul(x, case["weight"], case["scale"], case["zero"],
                                                                  case["group"]))
            records.append({"layer": layer, "method": method, "config": "chosen", "us": tuned,
                            "bw_fraction": case["bytes"] / (tuned * 1e-6) / bandwidth})
            for cfg in grid4 if method.startswith("int4") else grid8:
                out = torch.empty(1, n, device=DEVICE, dtype=x.dtype)
                record = {"layer": layer, "method": method, "config": "n{}_k{}_w{}_s{}".format(*cfg)}
                try:
                    run = _launch(case, x, out, n, k, cfg)
                    record["us"] = bench_us(run)
                    record["bw_fraction"] = case["bytes"] / (record["us"] * 1e-6) / bandwidth
                    error = ((out.float() - expected).abs().max() / expected.abs().max()).item()
                    record["max_rel_error"] = error
                    if error > 2e-2:
                        record["wrong"] = True
                except Exception as e:  # noqa: BLE001 (a tile that does not compile or fit is recorded)
                    record["error"] = f"{type(e).__name__}: {e}"[:200]
                records.append(record)
            best = min((r for r in records if r["layer"] == layer and r["method"] == method and "us" in r
                        and not r.get("wrong") and r["config"] != "chosen"), key=lambda r: r["us"], default=None)
            found = f"{best['config']} {best['us']:.1f} us" if best else "none (every tile failed)"
            print(f"{layer} {method}: bf16 {base:.1f} us, chosen {tuned:.1f} us, best {found}", flush=True)
    return records


def one_row_grid(args: argparse.Namespace, int4: bool) -> list[triton.Config]:
    """The tiles of `one_row_phase`: rows, inputs and warps of the grid (a thread holding from 4 to 64
    words of codes: fewer split a run of four words), with and without PREFETCH; float16 ones also
    with THREAD_RUNS where a tile has a run for each thread."""
    grid = []
    half = int4 and not args.float32_products
    for n, k, warps, prefetch in itertools.product(args.int4_block_n if int4 else args.block_n,
                                                   args.int4_block_k if int4 else args.block_k, args.warps,
                                                   (False, True)):
        words = n * k // (8 if int4 else 4) // (32 * warps)  # a thread's 32-bit words a tile
        if 4 <= words <= 64:
            for thread_runs in (False, True) if half and triton_matmul.thread_runs_fit(k, warps) else (False,):
                grid.append(triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PREFETCH": prefetch, "HALF": half,
                                           "THREAD_RUNS": thread_runs}, num_warps=warps, num_stages=3))
    return grid


def one_row_phase(args: argparse.Namespace, bandwidth: float, out_path: Path, payload: dict) -> list[dict[str, Any]]:
    from pagellm.ops.triton.one_row_tiles import replay_us, uncached_copies

    records = payload.setdefault("one_row", [])
    for layer, (n, k) in SHAPES.items():
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        x = torch.randn(1, k, device=DEVICE, generator=gen).bfloat16()
        layouts = quantized_layouts(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02)
        for method in args.one_row_methods:
            case = layouts[method]
            int4 = method.startswith("int4")
            weight = case["weight"].view(torch.int32) if int4 else case["weight"]
            zero_arg, zero_const = triton_matmul._zero_args(case["zero"], case["scale"])
            constants = dict(GROUP=case["group"], PACKED=int4, ZERO=zero_const, OFFSET=False,
                             PER_GROUP=case["group"] > 0)
            expected = (x.double() @ case["ref"].double().t())[0]
            out = torch.empty(n, device=DEVICE, dtype=torch.bfloat16)

            def run(config: triton.Config, w: torch.Tensor) -> None:
                triton_matmul.launch_one_row(config, n, (x, w, case["scale"], zero_arg, case["scale"], out, n, k,
                                                         w.stride(0), case["scale"].stride(0), zero_arg.stride(0)),
                                             **constants)
            copies = uncached_copies(weight)
            for config in one_row_grid(args, int4):
                record = {"layer": layer, "method": method, "config": str(config), **config.kwargs,
                          "warps": config.num_warps}
                try:
                    record["us"] = replay_us(lambda w, c=config: run(c, w), copies)
                    out.fill_(float("nan"))
                    run(config, weight)
                    record["max_rel_error"] = ((out.double() - expected).abs().max() / expected.abs().max()).item()
                    record["bw_fraction"] = case["bytes"] / (record["us"] * 1e-6) / bandwidth
                except Exception as e:  # noqa: BLE001 (a tile that does not compile or fit is recorded)
                    record["error"] = f"{type(e).__name__}: {e}"[:200]
                records.append(record)
            del copies
            for r in _fastest(records, layer, method)[:3]:
                print(f"{layer} {method}: {r['us']:.2f} us ({r['bw_fraction']:.2f} of copy bw, error "
                      f"{r['max_rel_error']:.1e}) {r['config']}", flush=True)
            write_json(payload, out_path)
    return records


def _fastest(records: list[dict[str, Any]], layer: str, method: str) -> list[dict[str, Any]]:
    """The timed one-row records of a layer and method, fastest first."""
    return sorted((r for r in records if r["layer"] == layer and r["method"] == method and "us" in r),
                  key=lambda r: r["us"])


def _grouped(n: int, k: int, gen: torch.Generator) -> dict[str, dict[str, Any]]:
    """int4 groups of 128 with zero points (GPTQ/AWQ/rtn), and GGUF's grouped layouts: Q4_K-like
    (packed, groups of 32, offsets) and Q8_0-like (8-bit codes, groups of 32)."""
    cases = {"int4_g128": quantized_layouts(torch.randn(n, k, device=DEVICE, generator=gen) * 0.02)["int4_g128"]}
    codes4 = torch.randint(0, 256, (n, k // 2), device=DEVICE, dtype=torch.uint8, generator=gen)
    scale32 = torch.rand(n, k // 32, device=DEVICE, generator=gen).half() * 0.01
    offset32 = -torch.rand(n, k // 32, device=DEVICE, generator=gen).half() * 0.05
    cases["q4k_like"] = dict(weight=codes4, scale=scale32, zero=0, group=32, offset=offset32)
    codes8 = torch.randint(-127, 128, (n, k), device=DEVICE, dtype=torch.int8, generator=gen)
    cases["q8_0_like"] = dict(weight=codes8, scale=scale32, zero=0, group=32, offset=None)
    return cases


def large_phase(args: argparse.Namespace) -> list[dict[str, Any]]:
    records = []
    threshold = triton_matmul.DEQUANTIZE_ROWS
    for layer, (n, k) in SHAPES.items():
        gen = torch.Generator(device=DEVICE).manual_seed(n + k)
        w16 = (torch.randn(n, k, device=DEVICE, generator=gen) * 0.02).bfloat16()
        cases = _grouped(n, k, gen)
        for rows in args.large_rows:
            x = torch.randn(rows, k, device=DEVICE, generator=gen).bfloat16()
            line = {"bf16": bench_us(lambda: F.linear(x, w16))}
            for method, c in cases.items():
                def call():
                    return triton_matmul.dequant_matmul(x, c["weight"], c["scale"], c["zero"], c["group"],
                                                        c.get("offset"))
                for path, rows_at in (("tiled", 1 << 30), ("dequantize+cuBLAS", 2)):
                    triton_matmul.DEQUANTIZE_ROWS = rows_at
                    try:
                        line[f"{method} {path}"] = bench_us(call)
                    except Exception as e:  # noqa: BLE001
                        line[f"{method} {path}"] = float("nan")
                        print(f"{layer} M={rows} {method} {path}: {type(e).__name__}: {e}"[:300], flush=True)
                triton_matmul.DEQUANTIZE_ROWS = threshold
            records += [{"layer": layer, "rows": rows, "method": m, "us": us} for m, us in line.items()]
            print(f"{layer} M={rows}: " + ", ".join(f"{m} {us:.1f}" for m, us in line.items()), flush=True)
    return records


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", nargs="+", default=["gemv", "large"])
    p.add_argument("--block-n", type=int, nargs="+", default=[1, 2, 4, 8], help="8-bit tiles' rows")
    p.add_argument("--block-k", type=int, nargs="+", default=[1024, 2048, 4096], help="8-bit tiles' inputs")
    p.add_argument("--int4-block-n", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--int4-block-k", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[3])
    p.add_argument("--one-row-methods", nargs="+", default=["int4_g128", "fp8"], choices=["int4_g128", "fp8", "int8"])
    p.add_argument("--float32-products", action="store_true", help="one_row: int4 without HALF")
    p.add_argument("--large-rows", type=int, nargs="+", default=[16, 32, 64, 128, 256, 1024])
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    payload: dict[str, Any] = {"metadata": run_metadata(args.commit), "args": vars(args)}
    payload["ceilings"] = measure_ceilings(torch.device(DEVICE), 1 << 30, 8192, torch.bfloat16)[1]
    out = Path(args.out_dir) / "gemv_sweep.json" if args.out_dir else default_result_path("gemv_sweep")
    if "gemv" in args.phases:
        payload["gemv"] = gemv_phase(args, payload["ceilings"]["copy_bytes_per_s"])
        write_json(payload, out)  # each phase's results kept as soon as they exist
    if "one_row" in args.phases:
        one_row_phase(args, payload["ceilings"]["copy_bytes_per_s"], out, payload)
    if "large" in args.phases:
        payload["large"] = large_phase(args)
    print(summary(payload))
    write_json(payload, out)
    return payload


def summary(payload: dict[str, Any]) -> str:
    lines = []
    gemv = payload.get("gemv") or []
    if gemv:
        rows = []
        for layer, method in dict.fromkeys((r["layer"], r["method"]) for r in gemv):
            mine = [r for r in gemv if r["layer"] == layer and r["method"] == method and "us" in r]
            tuned = next(r for r in mine if r["config"] in ("chosen", "cuBLAS"))  # always timed first
            ranked = sorted((r for r in mine if r is not tuned and not r.get("wrong")), key=lambda r: r["us"])
            for r in [tuned, *ranked[:3]]:
                rows.append([layer, method, r["config"], f"{r['us']:.1f}", f"{r['bw_fraction']:.2f}"])
        lines.append(format_table(["layer", "method", "tile", "us", "of copy bw"], rows, left=[0, 1, 2]))
    one_row = payload.get("one_row") or []
    if one_row:
        rows = []
        for layer, method in dict.fromkeys((r["layer"], r["method"]) for r in one_row):
            for r in _fastest(one_row, layer, method)[:5]:
                tile = (f"n{r['BLOCK_N']}_k{r['BLOCK_K']}_w{r['warps']}{'_pre' if r['PREFETCH'] else ''}"
                        f"{'_tr' if r.get('THREAD_RUNS') else ''}")
                rows.append([layer, method, tile, f"{r['us']:.2f}", f"{r['bw_fraction']:.2f}",
                             f"{r['max_rel_error']:.1e}"])
        lines.append(format_table(["layer", "method", "tile", "us", "of copy bw", "max rel error"], rows,
                                  left=[0, 1, 2]))
    large = payload.get("large") or []
    if large:
        methods = list(dict.fromkeys(r["method"] for r in large))
        table = []
        for layer, rows_ in dict.fromkeys((r["layer"], r["rows"]) for r in large):
            us = {r["method"]: r["us"] for r in large if r["layer"] == layer and r["rows"] == rows_}
            table.append([layer, rows_, *(f"{us[m]:.1f}" for m in methods)])
        lines.append(format_table(["layer", "M", *methods], table, left=[0]))
    return "\n\n".join(lines)


if __name__ == "__main__":
    main()
