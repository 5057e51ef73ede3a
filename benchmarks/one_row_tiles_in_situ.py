"""The one-row kernel's tiles timed where they run: batch-1 decode of the whole engine with each tile.

One engine (batch 1, dummy weights, weights quantized at load) decodes with the tiles
`one_row_tiles.choose` picked for each weight shape of the method, then with each candidate tile
forced on every one of those shapes (`uniform`), then, with `--per-shape`, on one shape at a time
while the others keep their choice. The decode graph is recaptured for each. This is the check of
a tile choice made outside the model (`benchmarks/gemv_sweep.py` times one layer over and over,
which a small weight answers from the L2 cache).

On the GPU machine, from the repository root:
    python3 -m benchmarks.one_row_tiles_in_situ --quantization fp8 --out-dir "$OUT"
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm import LLM
from pagellm.benchmarks.latency import measure_latency
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.ops.triton import one_row_tiles
from pagellm.ops.triton import matmul as triton_matmul
from pagellm.worker.cuda_graphs import DecodeGraphs

CODES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8, "rtn": torch.int32, "gptq": torch.int32,
         "awq": torch.int32}
"""The one-row kernel's weight dtype per method (4-bit codes travel as int32 words)."""


def decode_tok_s(llm: LLM) -> float:
    """Batch-1 decode tok/s, 128 in / 128 out, the mean over 3 runs after one warm-up."""
    return 1.0 / measure_latency(llm, 1, 128, 128, 3, 1, 0)["time_per_output_token_s"]["mean"]


def recapture(runner: Any) -> None:
    """The decode graph captured again, taking the tiles now in `one_row_tiles._CHOSEN`."""
    runner.graphs = None
    torch.cuda.empty_cache()
    max_blocks = -(-runner.config.model.max_model_len // runner.block_size)
    runner.graphs = DecodeGraphs(runner.model, 1, max_blocks, runner.device)
    runner.graphs.capture()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--quantization", choices=sorted(CODES), default="fp8")
    p.add_argument("--per-shape", action="store_true", help="also each tile on one weight shape at a time")
    p.add_argument("--out-dir", default=None, help="where the JSON goes; default benchmarks/results/")
    args = p.parse_args()

    started = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", quantization=args.quantization, max_num_seqs=1)
    runner = llm.llm_engine.engine_core.executor.worker.runner
    chosen = {key: config for key, config in one_row_tiles._CHOSEN.items()
              if key.weight_dtype == CODES[args.quantization]}
    if not chosen:
        raise SystemExit(f"no one-row products of {args.quantization} weights were timed at start-up")
    candidates = {key: triton_matmul.one_row_candidates(dict(key.layout), key.x_dtype, key.device) for key in chosen}
    result: dict[str, Any] = {"startup_s": time.perf_counter() - started, "chosen_tok_s": decode_tok_s(llm),
                              "chosen": {f"{key.n}x{key.k}": str(c) for key, c in chosen.items()}, "uniform": {},
                              "per_shape": {}}

    def forced(tiles: dict) -> float | str:
        one_row_tiles._CHOSEN.update(tiles)
        try:
            recapture(runner)
            return decode_tok_s(llm)
        except Exception as e:  # noqa: BLE001 (a tile that does not fit this shape: recorded)
            return f"{type(e).__name__}: {e}"[:200]
        finally:
            one_row_tiles._CHOSEN.update(chosen)

    rows = []
    for config in triton_matmul._gemv_configs(CODES[args.quantization] == torch.int32):
        if any(config not in fitting for fitting in candidates.values()):
            continue
        result["uniform"][str(config)] = tok_s = forced(dict.fromkeys(chosen, config))
        rows.append(["every shape", str(config), tok_s if isinstance(tok_s, str) else f"{tok_s:.1f}"])
    if args.per_shape:
        for key in chosen:
            shape = f"{key.n}x{key.k}"
            result["per_shape"][shape] = {str(c): forced({key: c}) for c in candidates[key]}
            for c, tok_s in result["per_shape"][shape].items():
                rows.append([shape, c, tok_s if isinstance(tok_s, str) else f"{tok_s:.1f}"])
    recapture(runner)
    result["chosen_again_tok_s"] = decode_tok_s(llm)
    payload = {"benchmark": "one_row_tiles_in_situ", **run_metadata(), "parameters": vars(args), **result}
    name = f"one_row_tiles_in_situ_{args.quantization}"
    out = Path(args.out_dir) / f"{name}.json" if args.out_dir else default_result_path(name)
    print(f"chosen tiles: {result['chosen_tok_s']:.1f} tok/s (again at the end: {result['chosen_again_tok_s']:.1f})")
    print(format_table(["forced on", "tile", "batch-1 tok/s"], rows))
    print("wrote", write_json(payload, out))


if __name__ == "__main__":
    main()
