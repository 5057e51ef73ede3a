"""Paged-attention kernel alone on the GPU: achieved KV bandwidth per launch configuration.

Llama-3.1-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, a bf16 or (--kv-cache-dtype
fp8) float8 cache, 16-token blocks in shuffled order). For decode batches the bytes are the KV read
once (every context token's K and V); the fraction is over the measured copy bandwidth. Each
configuration of `TUNING`'s decode entries is checked against the torch backend before it is timed.

    python3 -m benchmarks.attention_kernel_bench --out-dir "$OUT"
"""
from __future__ import annotations

import argparse
import copy
import itertools
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import triton.testing

from pagellm.ops.triton import attention as tk
from pagellm.attention.backend import AttentionMetadata
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.attention.triton_backend import decode_splits
from pagellm.benchmarks.results import format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import measure_ceilings

HEADS, KV_HEADS, DIM, BLOCK = 32, 8, 128, 16


def decode_batch(batch: int, ctx: int, gen: torch.Generator, cache_dtype: torch.dtype):
    blocks_per_seq = -(-ctx // BLOCK)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    table = perm.view(batch, blocks_per_seq).cuda()
    cache = [torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen).to("cuda", cache_dtype) for _ in range(2)]
    q = torch.randn(batch, HEADS, DIM, generator=gen).to("cuda", torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return q, cache, table, seq_lens, qsl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["256x1536", "64x2048", "1x4096"])
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                   help="the cache's entries: bfloat16 (auto) or float8 e4m3 (then f16_dots is swept too)")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    fp8 = args.kv_cache_dtype == "fp8"
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    ceilings, _ = measure_ceilings(torch.device("cuda"), 1 << 30, 4096, torch.bfloat16)
    bandwidth = ceilings.copy_bytes_per_s
    variants = [dict(block_n=bn, k_rows=kr, num_warps=nw, num_stages=ns, **({"f16_dots": f16} if fp8 else {}))
                for bn, kr, nw, ns, f16 in itertools.product([32, 64, 128, 256], [False, True], [4, 8], [2, 3],
                                                             [False, True] if fp8 else [False])]
    gen = torch.Generator().manual_seed(0)
    rows, results = [], []
    for shape in args.shapes:
        batch, ctx = map(int, shape.split("x"))
        q, cache, table, seq_lens, qsl = decode_batch(batch, ctx, gen, cache_dtype)
        splits = decode_splits(batch, KV_HEADS)
        kind = tk.tuning_kind(1, batch, KV_HEADS, cache_dtype)  # the engine's choice
        default = copy.deepcopy(tk.TUNING[kind])
        md = AttentionMetadata(batch, qsl, seq_lens, table, torch.full((batch,), -1, device="cuda"), 1, ctx,
                               qsl.cpu().numpy(), seq_lens.cpu().numpy())
        ref = TorchAttentionBackend().forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], tuple(cache), md, DIM**-0.5)
        kv_bytes = 2 * batch * ctx * KV_HEADS * DIM * cache[0].element_size()
        best = None
        for v in variants:
            tk.TUNING[kind] = v
            out = torch.full_like(q, float("nan"))
            try:
                tk.paged_attention(out, q, *cache, table, seq_lens, qsl, 1, DIM**-0.5, splits)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    results.append({"shape": shape, **v, "error": f"relative error {err}"})
                    continue
                ms = triton.testing.do_bench(
                    lambda: tk.paged_attention(out, q, *cache, table, seq_lens, qsl, 1, DIM**-0.5, splits),
                    warmup=20, rep=100, return_mode="median")
            except Exception as e:  # a configuration that does not compile (shared memory) is skipped
                results.append({"shape": shape, **v, "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            frac = kv_bytes / (ms * 1e-3) / bandwidth
            results.append({"shape": shape, **v, "ms": ms, "fraction_of_bandwidth": frac, "splits": splits})
            if v == default:
                rows.append([shape, f"default ({kind})", str(v), f"{ms * 1e3:.1f}", f"{frac:.2f}"])
            if best is None or ms < best[0]:
                best = (ms, v, frac)
        tk.TUNING[kind] = default
        if best is not None:
            rows.append([shape, "best", str(best[1]), f"{best[0] * 1e3:.1f}", f"{best[2]:.2f}"])
    payload = {**run_metadata(), "copy_bytes_per_s": bandwidth, "kv_cache_dtype": args.kv_cache_dtype,
               "results": results}
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / "attention_kernel_bench.json")
    print(format_table(["batch x ctx", "config", "params", "us", "of copy BW"], rows))


if __name__ == "__main__":
    main()
