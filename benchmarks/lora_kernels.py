"""Batched multi-LoRA kernels alone on one GPU: the shrink and expand of `pagellm.ops.triton.lora` against
the base layer's dense matmul, at Llama-3.1-8B shapes.

Modules: qkv (hidden 4096 -> q 4096 + k 1024 + v 1024, three parts), o (4096 -> 4096), gate_up (4096 ->
2 x 14336, two parts), down (14336 -> 4096); --slots adapters (8) of --rank (16; e.g. 64), bf16. Batches:
decode steps of 1, 8, 64 and 256 tokens spread evenly over the slots, and a prefill of 2048 tokens of
8 requests (a slot each, the requests' tokens contiguous). The tile plan is the fixed-size one a
CUDA graph would replay (`max_tiles` tiles, padding tiles included).

Each case is first checked at full size against the torch oracle (`pagellm.ops.lora`, in float32):
the largest absolute error of h and of y, asserted within tolerance. Then timed: CUDA events around
each call, a 256 MiB L2 flush queued before it (the weights cold, as in a model step, and the Python
launch hidden behind the flush), the median of --iters after --warmup calls. LoRA time is shrink +
expand, also as a fraction of the base matmul x @ W^T (W [N, K] bf16, cuBLAS).

On the GPU machine, from the repository root:
    python3 -m benchmarks.lora_kernels --out-dir "$OUT" --commit SHA [--rank 64]
Every code path on the CPU (Triton's interpreter, tiny sizes, timings meaningless):
    TRITON_INTERPRET=1 .venv/bin/python -m benchmarks.lora_kernels --smoke
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # read when the kernels are defined (at their import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.ops.lora import lora_expand_ref, lora_shrink_ref, max_tiles, plan_tiles
from pagellm.ops.triton.lora import BLOCK_M, lora_expand, lora_shrink, shrink_splits, to_device

MODULES = {"qkv": (4096, (0, 4096, 5120, 6144)), "o": (4096, (0, 4096)), "gate_up": (4096, (0, 14336, 28672)),
           "down": (14336, (0, 4096))}
"""Llama-3.1-8B's LoRA targets: (in_features K, part offsets of the out_features)."""
SMOKE_MODULES = {"qkv": (64, (0, 64, 80, 96)), "o": (64, (0, 64)), "gate_up": (64, (0, 112, 224)),
                 "down": (112, (0, 64))}
BATCHES = [("decode", 1), ("decode", 8), ("decode", 64), ("decode", 256), ("prefill", 2048)]
SMOKE_BATCHES = [("decode", 1), ("decode", 8), ("prefill", 32)]
PREFILL_REQUESTS = 8
FLUSH_BYTES = 256 << 20
DTYPE = torch.bfloat16
Y_TOLERANCE = 2**-6
"""Of y's largest magnitude: y rounded once to bfloat16 and h to bfloat16 before the expand's products
(2**-8 relative each, to nearest; the CPU interpreter truncates, 2**-7)."""
H_TOLERANCE = 1e-3
"""Of h's largest magnitude: float32 sums of exact products, in another order than the oracle's."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    modules, batches = (SMOKE_MODULES, SMOKE_BATCHES) if args.smoke else (MODULES, BATCHES)
    timer = Timer(device, args.warmup, args.iters)
    records = []
    for name, (k, part_offsets) in modules.items():
        for phase, tokens in batches:
            record = run_case(name, k, part_offsets, phase, tokens, args.slots, args.rank, device, timer)
            records.append(record)
            print(f"{name} {phase} {tokens}: base {record['base_us']:.1f} us, LoRA {record['lora_us']:.1f} us "
                  f"({record['lora_over_base']:.2f}), y error {record['y_max_abs_error']:.2g}", flush=True)
    payload = {"benchmark": "lora_kernels", **run_metadata(args.commit), "parameters": vars(args),
               "device": str(device), "block_m": BLOCK_M, "results": records}
    path = default_result_path(f"lora_kernels_rank{args.rank}")
    paths = [] if args.no_save else [write_json(payload, path)]
    if args.out_dir:
        paths.append(write_json(payload, Path(args.out_dir) / path.name))
    print(format_table(["module", "batch", "tokens", "tiles", "splits", "base us", "shrink us", "expand us", "LoRA us",
                        "LoRA / base", "y max err"],
                       [[r["module"], r["phase"], r["tokens"], r["tiles"], r["splits"], r["base_us"], r["shrink_us"],
                         r["expand_us"], r["lora_us"], r["lora_over_base"], f"{r['y_max_abs_error']:.2g}"]
                        for r in records], left=(0, 1)))
    print("wrote", ", ".join(map(str, paths)) or "nothing")
    return payload


def token_slots(phase: str, tokens: int, slots: int) -> np.ndarray:
    """Each token's slot: a decode step's tokens in turn over the slots, a prefill's requests in
    contiguous runs of tokens, request i in slot i % slots."""
    if phase == "decode":
        return np.arange(tokens, dtype=np.int32) % slots
    return (np.arange(tokens) * PREFILL_REQUESTS // tokens % slots).astype(np.int32)


def run_case(name: str, k: int, part_offsets: tuple[int, ...], phase: str, tokens: int, slots: int, rank: int,
             device: torch.device, timer: Timer) -> dict[str, Any]:
    """One module and batch: checked against the oracle, then timed."""
    gen = torch.Generator(device).manual_seed(tokens * 7919 + k)
    n, parts = part_offsets[-1], len(part_offsets) - 1

    def randn(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * scale).to(DTYPE)

    x = randn(tokens, k, scale=1.0)
    w = randn(n, k, scale=k**-0.5)
    a = randn(slots, parts * rank, k, scale=k**-0.5)
    b = randn(slots, n, rank, scale=rank**-0.5)
    row_slots = token_slots(phase, tokens, slots)
    tiles = to_device(plan_tiles(row_slots, BLOCK_M, max_tiles(tokens, slots, BLOCK_M)), device)
    base = F.linear(x, w)
    h = torch.empty(shrink_splits(k, tiles.num_tiles), tokens, parts * rank, device=device)
    y = base.clone()
    lora_shrink(x, a, tiles, h)
    lora_expand(y, h, b, part_offsets, tiles)

    slots_t = torch.from_numpy(row_slots).to(device)
    used = slots_t >= 0
    h_ref = lora_shrink_ref(x, a, slots_t)
    y_ref = base.float()
    lora_expand_ref(y_ref, h_ref, b, part_offsets, slots_t)
    check = {"h_max_abs_error": (h.sum(0)[used] - h_ref[used]).abs().max().item(),
             "y_max_abs_error": (y.float() - y_ref).abs().max().item(),
             "h_tolerance": H_TOLERANCE * h_ref.abs().max().item(),
             "y_tolerance": Y_TOLERANCE * y_ref.abs().max().item()}
    del h_ref, y_ref  # the oracle's gathered weights are large at full size
    if check["h_max_abs_error"] > check["h_tolerance"] or check["y_max_abs_error"] > check["y_tolerance"]:
        raise AssertionError(f"{name} {phase} {tokens}: the kernels disagree with the oracle: {check}")

    times = {"base_us": timer.median_us(lambda: F.linear(x, w)),
             "shrink_us": timer.median_us(lambda: lora_shrink(x, a, tiles, h)),
             "expand_us": timer.median_us(lambda: lora_expand(y, h, b, part_offsets, tiles))}
    times["lora_us"] = times["shrink_us"] + times["expand_us"]
    return {"module": name, "phase": phase, "tokens": tokens, "k": k, "n": n, "part_offsets": list(part_offsets),
            "rank": rank, "slots": slots, "tiles": tiles.num_tiles, "splits": h.shape[0], **check, **times,
            "lora_over_base": times["lora_us"] / times["base_us"]}


class Timer:
    """Median microseconds of a call after warm-up calls: on a GPU, CUDA events around each call with
    an L2 flush queued before it; on the CPU (the smoke run), wall time."""

    def __init__(self, device: torch.device, warmup: int, iters: int) -> None:
        self.warmup, self.iters = warmup, iters
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def median_us(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        if self.flush is None:
            for _ in range(self.iters):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e6)
            return statistics.median(times)
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            times.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) * 1e3 for start, end in times)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rank", type=int, default=16, help="the adapters' rank (all of them)")
    p.add_argument("--slots", type=int, default=8, help="adapters in the batch")
    p.add_argument("--iters", type=int, default=50, help="timed calls a measurement (the median is kept)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before them")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and batches, 3 timed calls, nothing saved "
                                                         "to benchmarks/results/ (for the CPU)")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--no-save", action="store_true", help="write the JSON only to --out-dir, not benchmarks/results/")
    p.add_argument("--commit", default=os.environ.get("PAGELLM_COMMIT"),
                   help="commit of the code, for a copy without git history (default: $PAGELLM_COMMIT)")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(iters=3, warmup=1, no_save=True)
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("the full sizes need a GPU; --smoke runs on the CPU")
    return args


if __name__ == "__main__":
    main()
