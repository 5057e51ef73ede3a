"""int4 one-row products on one GPU, every candidate tile at Llama-3.1-8B layer shapes: the CUDA-core
kernel's (`triton_matmul._gemv_kernel`) against the tensor-core one's (`int4_mma_gemv`), each
checked against float32 and timed as the engine times them at start-up (`one_row_tiles`: copies of
the weight that together pass the L2 cache, replayed in a CUDA graph), as a fraction of the
measured copy bandwidth, beside cuBLAS bf16 on the same shape.

The summary adds each kernel's best tile over a step's four projections (times 32 layers) and the
engine's choice (`one_row_tiles.choose` over both kernels' tiles).

On the GPU machine, from the repository root:
    python3 -m benchmarks.int4_one_row --out-dir "$OUT" --commit SHA
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F

from benchmarks.quant_gpu import SHAPES
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import measure_ceilings
from pagellm.quantization import int4_mma_gemv, one_row_tiles, triton_matmul
from pagellm.quantization.int4 import dequantize, pack_pairs, quantize_rtn

DEVICE = "cuda"
LAYERS = 32
TOLERANCE = 0.01
"""Largest error against float32, as a fraction of the largest output, a tile may have (bf16 cuBLAS
on the dequantized weight is shown beside it)."""


def layer_records(name: str, n: int, k: int, bandwidth: float) -> list[dict[str, Any]]:
    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    w = torch.randn(n, k, device=DEVICE, generator=gen) * 0.02
    x = torch.randn(1, k, device=DEVICE, generator=gen).bfloat16()
    q, scale, zero = quantize_rtn(w, 128)
    packed, scale = pack_pairs(q), scale.half()
    ref = dequantize(packed, scale, zero, 128)
    expected = x.float() @ ref.t()
    nbytes = n * k // 2 + n * k // 64  # codes, float16 scales and uint8 zero points of groups of 128
    words = packed.view(torch.int32)
    out = torch.empty(1, n, device=DEVICE, dtype=torch.bfloat16)
    layout = dict(GROUP=128, PACKED=True, ZERO=-1, OFFSET=False)
    constants = dict(**layout, PER_GROUP=True)

    def error(result: torch.Tensor) -> float:
        return ((result.float() - expected).abs().max() / expected.abs().max()).item()

    w16 = ref.bfloat16()
    records = [{"layer": name, "kernel": "cuBLAS bf16", "tile": "", "bytes": 2 * n * k,
                "us": one_row_tiles.replay_us(lambda m: F.linear(x, m), one_row_tiles.uncached_copies(w16)),
                "max_rel_error": error(F.linear(x, w16))}]
    del w16
    copies = one_row_tiles.uncached_copies(words)
    for config in triton_matmul.one_row_tiles(constants, n, k, x.dtype):
        kernel = "tensor cores" if config.kwargs.get("MMA") else "cuda cores"
        def run(weight: torch.Tensor, config=config) -> None:
            if config.kwargs.get("MMA"):
                int4_mma_gemv.launch(config, x, weight, scale, zero, out, n, k, weight.stride(0), scale.stride(0),
                                     zero.stride(0), 128, -1)
            else:
                triton_matmul.launch_one_row(config, n, (x, weight, scale, zero, scale, out, n, k, weight.stride(0),
                                                         scale.stride(0), zero.stride(0)), **constants)
        record = {"layer": name, "kernel": kernel, "bytes": nbytes,
                  "tile": ",".join(f"{key}={v}" for key, v in config.kwargs.items() if key != "MMA")
                  + f",warps={config.num_warps}"}
        try:
            out.zero_()
            run(words)
            torch.cuda.synchronize()
            record["max_rel_error"] = error(out)
            record["us"] = one_row_tiles.replay_us(run, copies)
            # twice more after the timing's many replays: the counters of split tiles must still be zeroed
            run(words)
            run(words)
            record["max_rel_error_after"] = error(out)
        except Exception as e:  # noqa: BLE001 (a tile that does not compile or fit is recorded)
            record["error"] = f"{type(e).__name__}: {e}"[:300]
        records.append(record)
    for r in records:
        if "us" in r:
            r["bw_fraction"] = r["bytes"] / (r["us"] * 1e-6) / bandwidth
            r["wrong"] = max(r["max_rel_error"], r.get("max_rel_error_after", 0)) > TOLERANCE
    with one_row_tiles.timing_one_row_products():  # the engine's choice over both kernels' tiles
        triton_matmul.dequant_matmul(x, packed, scale, zero, 128, out=out)
    torch.cuda.synchronize()
    return records


def best(records: list[dict[str, Any]], layer: str, kernel: str) -> dict[str, Any] | None:
    return min((r for r in records if r["layer"] == layer and r["kernel"] == kernel and "us" in r
                and not r["wrong"]), key=lambda r: r["us"], default=None)


def summary(records: list[dict[str, Any]]) -> str:
    rows, totals = [], {}
    for layer in SHAPES:
        for kernel in ("cuBLAS bf16", "cuda cores", "tensor cores"):
            r = best(records, layer, kernel)
            if r is None:
                rows.append([layer, kernel, "none correct", "", "", ""])
                continue
            totals[kernel] = totals.get(kernel, 0.0) + r["us"]
            rows.append([layer, kernel, r["tile"], f"{r['us']:.1f}", f"{r['bw_fraction']:.2f}",
                         f"{r['max_rel_error']:.4f}"])
    for kernel, us in totals.items():
        rows.append(["step (x32)", kernel, "", f"{LAYERS * us / 1e3:.3f} ms", "", ""])
    wrong = [f"{r['layer']} {r['tile']}" for r in records if r.get("wrong")]
    text = format_table(["layer", "kernel", "best tile", "us", "of copy bw", "max rel err"], rows, left=[0, 1, 2])
    return text + (f"\nwrong results (> {TOLERANCE}): {wrong}" if wrong else "")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    payload: dict[str, Any] = {"metadata": run_metadata(args.commit), "args": vars(args)}
    payload["ceilings"] = measure_ceilings(torch.device(DEVICE), 1 << 30, 8192, torch.bfloat16)[1]
    bandwidth = payload["ceilings"]["copy_bytes_per_s"]
    records: list[dict[str, Any]] = []
    for name, (n, k) in SHAPES.items():
        records += layer_records(name, n, k, bandwidth)
        print(f"{name} done", flush=True)
    payload["records"] = records
    payload["chosen"] = {str(key): f"{c.kwargs} warps={c.num_warps}" for key, c in one_row_tiles._CHOSEN.items()}
    print(summary(records))
    print("engine's choices:", *payload["chosen"].values(), sep="\n  ")
    out = Path(args.out_dir) / "int4_one_row.json" if args.out_dir else default_result_path("int4_one_row")
    write_json(payload, out)
    return payload


if __name__ == "__main__":
    main()
