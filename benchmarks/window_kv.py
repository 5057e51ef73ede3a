"""KV blocks a sequence holds with sliding-window layers, three ways in one run: the window arithmetic,
`pagellm plan`'s ledger, and the engine stepping one long request (dummy weights, real shapes).

Each KV cache group (full-attention layers; layers of one window) holds its own blocks: a full group
grows with the context, a windowed group holds at most the blocks its window spans. The engine's
count is the most each group held while the request decoded (a prompt chunk holds every block it
writes, reported apart).

    python3 -m benchmarks.window_kv --out-dir "$OUT" --commit SHA              # a GPU, Gemma-3 12B at 8k
    .venv/bin/python -m benchmarks.window_kv --smoke                           # the CPU, tiny sizes
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagellm import LLM, SamplingParams  # noqa: E402
from pagellm.benchmarks.datasets import random_requests  # noqa: E402
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json  # noqa: E402
from pagellm.loader.presets import get_preset  # noqa: E402

_SMOKE = {"context": 160, "output_len": 24}
_SMOKE_SHAPE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
                "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32,
                "sliding_window": 40, "torch_dtype": "float32"}
"""--smoke: the preset's config at tiny sizes (the layer pattern kept), 6 layers, a 40-token window."""


def window_arithmetic(window: int | None, num_tokens: int, block_size: int) -> int:
    """The most blocks a group holds, from first principles: every block of the sequence without a
    window; with one, a decode step at position p reads positions p - window + 1 .. p, which lie in
    at most ceil((window - 1) / block_size) + 1 blocks (a block is given back once no later
    position's window reaches it)."""
    every = -(-num_tokens // block_size)
    return every if window is None else min(every, -(-(window - 1) // block_size) + 1)


def plan_groups(model: str, context: int, output_len: int, block_size: int) -> list[dict[str, Any]]:
    """`pagellm plan --json`, as a user runs it: its KV cache groups and their blocks per sequence."""
    command = [sys.executable, "-m", "pagellm.cli", "plan", model, "--json", "--max-model-len", str(context),
               "--input-len", str(context - output_len), "--output-len", str(output_len),
               "--block-size", str(block_size), "--gpu-memory-gib", "80"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["kv_cache_groups"]


def engine_blocks(model: str, context: int, output_len: int, block_size: int, device: str) -> dict[str, Any]:
    """Step one request of `context` tokens (prompt + output); per group, the most blocks it held."""
    llm = LLM(model, load_format="dummy", max_model_len=context, block_size=block_size, device=device,
              max_num_seqs=1)
    engine = llm.llm_engine
    kv = engine.engine_core.scheduler.kv
    vocab = engine.config.model.source.arch.vocab_size
    prompt = random_requests(1, context - output_len, 1, vocab, 0)[0].prompt_token_ids
    engine.add_request("long", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True))
    request = engine.engine_core.scheduler.requests["long"]
    prefill, decode = [0] * kv.num_groups, [0] * kv.num_groups
    while engine.has_unfinished_requests():
        # A prompt chunk holds every block it writes (the chunk attends to all of them); the
        # window's bound holds from the first decode step on.
        most = decode if request.num_computed_tokens >= request.num_prompt_tokens else prefill
        engine.step()
        most[:] = [max(m, n) for m, n in zip(most, kv.num_blocks_held("long"))]
    return {"windows": list(kv.windows), "prefill_most_blocks": prefill, "decode_most_blocks": decode,
            "num_kv_blocks": engine.engine_core.num_blocks}


def smoke_model(preset: str, folder: Path) -> str:
    """A directory holding the preset's config.json at tiny sizes."""
    found = get_preset(preset)
    if found is None:
        raise ValueError(f"--smoke needs a preset name, not {preset!r}")
    (folder / "config.json").write_text(json.dumps({**found[0], **_SMOKE_SHAPE}))
    return str(folder)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="google/gemma-3-12b-it", help="a preset or config with windowed layers")
    p.add_argument("--context", type=int, default=8192, help="prompt + output tokens of the one request")
    p.add_argument("--output-len", type=int, default=64,
                   help="decode steps; at least --block-size, so that the window meets every block alignment")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--smoke", action="store_true", help=f"the CPU, the preset at tiny sizes: {_SMOKE}")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--no-save", action="store_true", help="write the JSON only to --out-dir")
    p.add_argument("--commit", default=None, help="the code's commit, for a copy without git history")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.smoke:
            vars(args).update(_SMOKE, device="cpu")
            model = smoke_model(args.model, Path(tmp))
        planned = plan_groups(model, args.context, args.output_len, args.block_size)
        engine = engine_blocks(model, args.context, args.output_len, args.block_size, args.device)
    if [g["sliding_window"] for g in planned] != engine["windows"]:
        raise RuntimeError(f"plan's groups {planned} are not the engine's {engine['windows']}")
    rows, groups = [], []
    for group, held, peak in zip(planned, engine["decode_most_blocks"], engine["prefill_most_blocks"]):
        arithmetic = window_arithmetic(group["sliding_window"], args.context, args.block_size)
        groups.append({"sliding_window": group["sliding_window"], "num_layers": len(group["layers"]),
                       "arithmetic_blocks": arithmetic, "plan_blocks": group["blocks_per_seq"],
                       "engine_decode_most_blocks": held, "engine_prefill_most_blocks": peak})
        rows.append([group["sliding_window"] or "full", len(group["layers"]), arithmetic, group["blocks_per_seq"],
                     held, peak])
    print(format_table(["window", "layers", "arithmetic", "plan", "engine (decode)", "engine (prefill)"], rows))
    payload = {"benchmark": "window_kv", **run_metadata(args.commit), "parameters": vars(args), "groups": groups,
               "num_kv_blocks": engine["num_kv_blocks"],
               "all_match": all(g["arithmetic_blocks"] == g["plan_blocks"] == g["engine_decode_most_blocks"]
                                for g in groups)}
    print("arithmetic, plan and engine agree" if payload["all_match"] else "MISMATCH")
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / default_result_path("window_kv").name)
    if not (args.smoke or args.no_save):
        write_json(payload, default_result_path("window_kv"))
    return payload

if __name__ == "__main__":
    main()
