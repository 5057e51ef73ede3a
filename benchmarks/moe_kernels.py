"""The fused MoE kernels alone on one GPU (`pagellm.ops.triton.moe`) against a per-expert loop of
`F.linear` calls (`fused_moe_ref`, the obvious implementation), at two models' expert shapes.

Models: Qwen3-30B-A3B (hidden 2048, moe_intermediate 768, 128 experts, top-8) and Mixtral-8x7B
(hidden 4096, intermediate 14336, 8 experts, top-2), bf16, random weights. Batches of 1, 4, 16, 64,
256, 1024 and 4096 tokens, each routed by `select_experts` (softmax, renormalised) on random logits.

Each case is first checked at full size: the fused output against the loop's (largest absolute error,
asserted within 2**-5 of the output's largest magnitude: both round to bf16 at several points), and
a CUDA graph captured of the fused call is replayed with another routing copied into its inputs and
then the first one, each bit-identical to the eager call (the plan is on the device: the graph must
follow the new experts).
Then timed: CUDA events around each call with a 256 MiB L2 flush queued before it (the weights cold,
as in a model's step), the median of --iters after --warmup calls; the fused call eagerly (Python
launches hidden behind the flush where they can be) and as the graph replay (as the engine's decode
runs), the loop eagerly (it syncs with the host to find each expert's tokens).

The floor of a call: the bytes of the experts it actually reads (those chosen by at least one token,
3 x intermediate x hidden x 2 bytes each) at the copy bandwidth measured in the same run (bytes read +
written a second), or its FLOPs (2 x pairs x 3 x intermediate x hidden) at the measured bf16 matmul
rate, whichever is longer. `graph / floor` is the floor over the graph replay's time: 1.0 would be
the weights streamed at copy speed (decode) or the tensor cores busy throughout (prefill).

With --sweep, each case's graph replay is also timed with every tile configuration of a grid
(`SWEEP_GRID`, or --sweep-configs), each checked against the loop first, and the fastest is reported
beside the default's: the data `pagellm.ops.triton.moe`'s table of tiles is set from.

On the GPU machine, from the repository root:
    python3 -m benchmarks.moe_kernels --out-dir "$OUT" --commit SHA
    python3 -m benchmarks.moe_kernels --sweep --tokens 1 4 16 --out-dir "$OUT" --commit SHA
Every code path on the CPU (Triton's interpreter, tiny sizes, timings meaningless):
    TRITON_INTERPRET=1 .venv/bin/python -m benchmarks.moe_kernels --smoke
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

if not torch.cuda.is_available():  # read when the kernels are defined (at their import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.lora_kernels import Timer
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import Ceilings, measure_ceilings
from pagellm.ops.moe import fused_moe_ref, select_experts
from pagellm.ops.triton.moe import MoEConfig, choose_config, fused_moe


class MoEShape(NamedTuple):
    hidden: int
    intermediate: int
    experts: int
    top_k: int


MODELS = {"qwen3-30b-a3b": MoEShape(2048, 768, 128, 8), "mixtral-8x7b": MoEShape(4096, 14336, 8, 2)}
SMOKE_MODELS = {"qwen3-30b-a3b": MoEShape(64, 48, 16, 4), "mixtral-8x7b": MoEShape(96, 80, 4, 2)}
TOKENS = [1, 4, 16, 64, 256, 1024, 4096]
SMOKE_TOKENS = [1, 4, 16]
DTYPE = torch.bfloat16
TOLERANCE = 2**-5
"""Of the output's largest magnitude."""
COPY_BYTES, MATMUL_SIZE = 1 << 30, 8192
SMOKE_COPY_BYTES, SMOKE_MATMUL_SIZE = 1 << 24, 256
SWEEP_GRID = [MoEConfig(16, n, k, w, s) for n, k, w, s in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 5))]
"""--sweep's tiles (BLOCK_M 16: the small batches the engine decodes)."""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    models = {name: (SMOKE_MODELS if args.smoke else MODELS)[name] for name in args.models}
    timer = Timer(device, args.warmup, args.iters)
    sweep = (args.sweep_configs or SWEEP_GRID) if args.sweep else []
    ceilings, ceilings_record = measure_ceilings(device, SMOKE_COPY_BYTES if args.smoke else COPY_BYTES,
                                                 SMOKE_MATMUL_SIZE if args.smoke else MATMUL_SIZE, DTYPE)
    print(f"copy {ceilings.copy_bytes_per_s / 1e12:.2f} TB/s (read + written), "
          f"bf16 matmul {ceilings.matmul_flops_per_s / 1e12:.0f} TFLOP/s", flush=True)
    records = []
    for name, shape in models.items():
        gen = torch.Generator(device).manual_seed(len(name))
        w13 = (torch.randn(shape.experts, 2 * shape.intermediate, shape.hidden, generator=gen, device=device)
               * shape.hidden**-0.5).to(DTYPE)
        w2 = (torch.randn(shape.experts, shape.hidden, shape.intermediate, generator=gen, device=device)
              * shape.intermediate**-0.5).to(DTYPE)
        for tokens in args.tokens:
            record = run_case(name, shape, tokens, w13, w2, gen, timer, ceilings, sweep)
            records.append(record)
            print(f"{name} T={tokens}: fused {record['fused_us']:.1f} us, graph {_fmt(record['graph_us'])} us, "
                  f"loop {record['loop_us']:.1f} us, graph / floor {_fmt(record['graph_over_floor'], '.2f')}",
                  flush=True)
        del w13, w2
    payload = {"benchmark": "moe_kernels", **run_metadata(args.commit),
               "parameters": {**vars(args), "sweep_configs": [_config_text(c) for c in sweep]},
               "device": str(device), "dtype": str(DTYPE).removeprefix("torch."), "ceilings": ceilings_record,
               "results": records}
    path = default_result_path("moe_kernels")
    paths = [] if args.no_save else [write_json(payload, path)]
    if args.out_dir:
        paths.append(write_json(payload, Path(args.out_dir) / path.name))
    print(format_table(["model", "tokens", "block_m", "experts read", "weights MB", "floor us", "fused us",
                        "graph us", "loop us", "loop / graph", "graph / floor", "weights GB/s", "max err"],
                       [[r["model"], r["tokens"], r["block_m"], r["experts_read"], r["weight_bytes"] / 1e6,
                         r["floor_us"], r["fused_us"], _fmt(r["graph_us"]), r["loop_us"],
                         _fmt(r["loop_over_graph"], ".2f"), _fmt(r["graph_over_floor"], ".2f"),
                         r["weight_bytes"] / (r["best_us"] * 1e3), f"{r['max_abs_error']:.2g}"]
                        for r in records], left=(0,)))
    print("wrote", ", ".join(map(str, paths)) or "nothing")
    return payload


def run_case(name: str, shape: MoEShape, tokens: int, w13: torch.Tensor, w2: torch.Tensor, gen: torch.Generator,
             timer: Timer, ceilings: Ceilings, sweep: list[MoEConfig]) -> dict[str, Any]:
    """One model and batch: checked, then timed (and with each of `sweep`'s tiles)."""
    device = w13.device

    def route() -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(torch.randn(tokens, shape.experts, generator=gen, device=device), shape.top_k, True)

    x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(DTYPE)
    weights, ids = route()
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    scale = ref.float().abs().max().item()

    def check(config: MoEConfig | None) -> float:
        error = (fused_moe(x, w13, w2, weights, ids, config).float() - ref.float()).abs().max().item()
        if error > TOLERANCE * scale:
            raise AssertionError(f"{name} T={tokens} {config}: the fused kernels disagree with the loop: {error} "
                                 f"(largest output {scale})")
        return error

    error = check(None)

    times = {"fused_us": timer.median_us(lambda: fused_moe(x, w13, w2, weights, ids)),
             "loop_us": timer.median_us(lambda: fused_moe_ref(x, w13, w2, weights, ids)), "graph_us": None}
    swept = []
    if device.type == "cuda":
        times["graph_us"] = timer.median_us(capture(x, w13, w2, (weights, ids), route()).replay)
    for config in sweep:
        check(config)
        call = (capture(x, w13, w2, (weights, ids), route(), config).replay if device.type == "cuda"
                else lambda c=config: fused_moe(x, w13, w2, weights, ids, c))
        swept.append({"config": _config_text(config), "us": timer.median_us(call)})
    if swept:
        fastest = min(swept, key=lambda r: r["us"])
        print(f"{name} T={tokens}: fastest of {len(swept)} tiles {fastest['config']} {fastest['us']:.1f} us "
              f"(default {_config_text(choose_config(tokens * shape.top_k, shape.experts, DTYPE))} "
              f"{_fmt(times['graph_us'] or times['fused_us'])} us)", flush=True)
    experts_read = int(torch.unique(ids[ids >= 0]).numel())
    weight_bytes = experts_read * 3 * shape.intermediate * shape.hidden * w13.element_size()
    flops = 2 * tokens * shape.top_k * 3 * shape.intermediate * shape.hidden
    floor_us = max(weight_bytes / ceilings.copy_bytes_per_s, flops / ceilings.matmul_flops_per_s) * 1e6
    best_us = times["graph_us"] or times["fused_us"]
    return {"model": name, "tokens": tokens, **shape._asdict(), "block_m": choose_config(
                tokens * shape.top_k, shape.experts, DTYPE).block_m,
            "experts_read": experts_read, "weight_bytes": weight_bytes, "flops": flops, "floor_us": floor_us,
            "max_abs_error": error, "max_abs_output": scale, **times, "best_us": best_us,
            "loop_over_graph": times["loop_us"] / times["graph_us"] if times["graph_us"] else None,
            "graph_over_floor": floor_us / times["graph_us"] if times["graph_us"] else None,
            "fused_over_floor": floor_us / times["fused_us"],
            "weight_fraction_of_copy_bandwidth": weight_bytes / (best_us * 1e-6) / ceilings.copy_bytes_per_s,
            "sweep": swept}


def capture(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor],
            other: tuple[torch.Tensor, torch.Tensor], config: MoEConfig | None = None) -> torch.cuda.CUDAGraph:
    """A CUDA graph of the fused call (with `config`'s tiles; None: the default's) on copies of
    `routing` (weights, ids), checked: bit-identical to the eager call, and following `other`
    routing copied into its inputs. Left with `routing`."""
    static = tuple(t.clone() for t in routing)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and allocate outside the capture
        fused_moe(x, w13, w2, *static, config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fused_moe(x, w13, w2, *static, config)
    for inputs in (other, routing):
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        graph.replay()
        if not torch.equal(static_out, fused_moe(x, w13, w2, *inputs, config)):
            raise AssertionError("the graph replay differs from the eager call on the routing copied in")
    return graph


def _config_text(config: MoEConfig) -> str:
    return ",".join(str(v) for v in (config.block_m, config.block_n, config.block_k, config.num_warps,
                                      config.num_stages))


def _parse_config(text: str) -> MoEConfig:
    try:
        return MoEConfig(*(int(v) for v in text.split(",")))
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected BLOCK_M,BLOCK_N,BLOCK_K,WARPS,STAGES, not {text!r}") from None


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS), help="expert shapes to run")
    p.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="batch sizes in tokens")
    p.add_argument("--iters", type=int, default=50, help="timed calls a measurement (the median is kept)")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before them")
    p.add_argument("--smoke", action="store_true", help="tiny shapes and batches, 3 timed calls, nothing saved "
                                                         "to benchmarks/results/ (for the CPU)")
    p.add_argument("--sweep", action="store_true", help="also time each case with every tile configuration of "
                                                        "the grid (see the module's docstring)")
    p.add_argument("--sweep-configs", nargs="+", type=_parse_config, default=None, metavar="M,N,K,WARPS,STAGES",
                   help="--sweep's configurations instead of the grid")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--no-save", action="store_true", help="write the JSON only to --out-dir, not benchmarks/results/")
    p.add_argument("--commit", default=os.environ.get("PAGELLM_COMMIT"),
                   help="commit of the code, for a copy without git history (default: $PAGELLM_COMMIT)")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(iters=3, warmup=1, no_save=True, tokens=SMOKE_TOKENS)
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        p.error("the full sizes need a GPU; --smoke runs on the CPU")
    return args


if __name__ == "__main__":
    main()
