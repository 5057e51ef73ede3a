"""Small-batch linear layers alone on the GPU: achieved weight bandwidth of cuBLAS, cuBLASLt and
the Triton GEMV (`pagellm/ops/triton_gemv.py`) per launch configuration.

Llama-3.1-8B's projections (qkv, o, gate_up, down, lm_head), bf16, at 1-4 rows. The bytes are the
weight read once; the fraction is over the copy bandwidth measured in the same run. Every Triton
configuration is checked against F.linear before it is timed.

    python3 -m benchmarks.gemv_bench --out-dir "$OUT"
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
import triton.testing

from pagellm.benchmarks.results import format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import measure_ceilings
from pagellm.ops import triton_gemv

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
"""(N, K) of Llama-3.1-8B's weights."""


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    ceilings, _ = measure_ceilings(torch.device("cuda"), 1 << 30, 4096, torch.bfloat16)
    bandwidth = ceilings.copy_bytes_per_s
    variants = [dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                for bn, bk, nw, ns in itertools.product([4, 8, 16], [256, 512, 1024], [4, 8], [3, 5])]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, results = [], []
    totals: dict[tuple[int, str], float] = {}
    for m, (name, (n, k)) in itertools.product(args.rows, SHAPES.items()):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        ref = F.linear(x, w).float()
        frac = lambda ms: n * k * 2 / (ms * 1e-3) / bandwidth  # noqa: E731
        timed = {}
        for lib in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(lib)
            timed[lib] = bench(lambda: F.linear(x, w))
        torch.backends.cuda.preferred_blas_library("cublas")
        best = None
        for v in variants:
            try:
                out = triton_gemv.gemv(x, w, config=v).float()
                err = ((out - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    results.append({"rows": m, "shape": name, **v, "error": f"relative error {err}"})
                    continue
                ms = bench(lambda: triton_gemv.gemv(x, w, config=v))
            except Exception as e:  # a configuration that does not compile is skipped
                results.append({"rows": m, "shape": name, **v, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            results.append({"rows": m, "shape": name, **v, "ms": ms, "fraction_of_bandwidth": frac(ms)})
            if v == triton_gemv.TUNING:
                timed["triton default"] = ms
            if best is None or ms < best[0]:
                best = (ms, v)
        timed["triton best"] = best[0]
        for label, ms in timed.items():
            totals[(m, label)] = totals.get((m, label), 0.0) + ms
            results.append({"rows": m, "shape": name, "impl": label, "ms": ms, "fraction_of_bandwidth": frac(ms)})
        rows.append([m, name, *(f"{timed[key] * 1e3:.1f} ({frac(timed[key]):.2f})" for key in
                                ("cublas", "cublaslt", "triton default", "triton best")), str(best[1])])
    payload = {**run_metadata(), "copy_bytes_per_s": bandwidth, "results": results,
               "per_step_ms": {f"{m} rows {label}": ms for (m, label), ms in totals.items()}}
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / "gemv_bench.json")
    print(format_table(["rows", "weight", "cublas us (of BW)", "cublaslt", "triton default", "triton best",
                        "best config"], rows))
    for (m, label), ms in sorted(totals.items()):
        print(f"rows {m} {label}: sum over the five weights {ms * 1e3:.1f} us")


if __name__ == "__main__":
    main()
