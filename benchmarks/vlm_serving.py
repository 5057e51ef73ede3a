"""Images in, text out, offline: N chat prompts with one image each through pagellm (`LLM.generate` with
`multi_modal_data`, the model's processor preparing every image), against Hugging Face's batched
`generate` on the first K of the same requests with the same weights, in the same run.

The model is random with a real model's shapes (`--model-shape`, a key of `vlm_models.SHAPES`:
LLaVA-1.5-7B, the default, or Qwen2.5-VL-7B), built with `transformers` from its config classes and
saved with a processor (a word-level tokenizer with the family's special tokens, the family's image
processor), so no download is needed; both engines load that folder. The default stays LLaVA-1.5-7B
so that the recorded runs' commands still mean what they meant. Throughput counts the 128 requested
output tokens of every request (EOS ignored); TTFT is from the batch's start (every request arrives
at once) to its first token. Each engine runs in a process of its own, one after the other, so the
second finds the GPU's memory free.

    python -m benchmarks.vlm_serving --out-dir "$OUT" --commit SHA     # one GPU, LLaVA-1.5-7B shapes
    python -m benchmarks.vlm_serving --model-shape qwen2.5-vl-7b --out-dir "$OUT" --commit SHA
    python -m benchmarks.vlm_serving --smoke                          # the CPU, a tiny LLaVA
    python -m benchmarks.vlm_serving --smoke --model-shape tiny-qwen2.5-vl

Prints a table and writes JSON under benchmarks/results/ (hardware, date, command, commit).
"""
from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.vlm_models import SHAPES, build_model, family
from pagellm import LLM, SamplingParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, summarize, write_json

_SMOKE = {"num_requests": 8, "hf_requests": 4, "hf_batch_size": 2, "output_len": 8, "image_size": 32,
          "text_words": 8, "dtype": "float32", "device": "cpu", "max_model_len": 256}
_TINY = ("tiny", "tiny-qwen2.5-vl")
"""The shapes `--smoke` takes (default: tiny, a LLaVA)."""


def requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prompts of `text_words` random words around one random image each (all distinct)."""
    rng = np.random.default_rng(args.seed)
    spec = SHAPES[args.model_shape]
    last_word = min(spec["text"]["vocab_size"], *spec["special_tokens"].values())
    out = []
    for _ in range(args.num_requests):
        words = [f"t{w}" for w in rng.integers(3, last_word, args.text_words)]
        pixels = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
        out.append({"prompt": family(args.model_shape).prompt(words),
                    "multi_modal_data": {"image": Image.fromarray(pixels)}})
    return out


def run_pagellm(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """Every request at once through one LLM; throughput and TTFT from the batch's start."""
    kwargs = {"device": args.device} if args.device else {}
    llm = LLM(folder, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(requests(argparse.Namespace(**{**vars(args), "num_requests": 2, "seed": args.seed + 1})),
                 params, use_tqdm=False)  # warm-up (kernels, the processor's import)
    prompts = requests(args)
    engine = llm.llm_engine
    start = time.perf_counter()
    ids = []
    for prompt in prompts:
        ids.append(engine.next_request_id())
        engine.add_request(ids[-1], prompt, params)
    prepared = time.perf_counter() - start
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - start
            tokens[out.request_id] = len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    output_tokens = sum(tokens.values())
    return {"elapsed_s": elapsed, "prepare_s": prepared, "num_requests": len(prompts), "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / elapsed, "requests_per_s": len(prompts) / elapsed,
            "ttft_s": summarize([first[i] for i in ids])}


def run_hf(folder: str, args: argparse.Namespace) -> dict[str, Any]:
    """The first `hf_requests` in static batches of `hf_batch_size` through HF's `generate` (left
    padded, greedy, exactly output_len new tokens); TTFT: a batch's prefill and first token, from the
    run's start."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    model = family(args.model_shape).model_class.from_pretrained(folder, dtype=dtype).to(device).eval()
    prepare = family(args.model_shape).hf_inputs(folder)
    prompts = requests(args)[:args.hf_requests]

    def generate(batch: list[dict[str, Any]], new_tokens: int) -> None:
        inputs = prepare([p["prompt"] for p in batch], [p["multi_modal_data"]["image"] for p in batch]).to(device)
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        if device != "cpu":
            torch.cuda.synchronize()

    generate(prompts[:1], 2)  # warm-up
    batches = [prompts[i:i + args.hf_batch_size] for i in range(0, len(prompts), args.hf_batch_size)]
    start = time.perf_counter()
    ttft = []
    for batch in batches:
        begun = time.perf_counter()
        generate(batch, 1)
        # The batch's wait (the batches before it) and its prefill with the first token; the probe
        # itself is then left out of the timed run.
        ttft += [time.perf_counter() - start] * len(batch)
        start += time.perf_counter() - begun
        generate(batch, args.output_len)
    elapsed = time.perf_counter() - start
    output_tokens = len(prompts) * args.output_len
    return {"elapsed_s": elapsed, "num_requests": len(prompts), "batch_size": args.hf_batch_size,
            "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / elapsed,
            "ttft_s": summarize(ttft)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.smoke:
        if args.model_shape not in _TINY:
            raise ValueError(f"--model-shape: --smoke takes one of {_TINY}, not {args.model_shape!r}")
        for key, value in _SMOKE.items():
            setattr(args, key, value)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        build_model(args.model_shape, Path(tmp), getattr(torch, args.dtype), device)
        if device != "cpu":
            torch.cuda.empty_cache()
        # Each engine in a process of its own: the next finds the accelerator's memory free.
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1) as pool:
            hf = pool.submit(run_hf, tmp, args).result()
            ours = pool.submit(run_pagellm, tmp, args).result()
    payload = {"benchmark": "vlm_serving", **run_metadata(args.commit),
               "parameters": {k: v for k, v in vars(args).items() if k not in ("out_dir", "commit")},
               "results": {"pagellm": ours, "hf": hf},
               "throughput_ratio": ours["output_tokens_per_s"] / hf["output_tokens_per_s"]}
    print(_table(payload))
    if not args.smoke:
        write_json(payload, default_result_path("vlm_serving"))
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / default_result_path("vlm_serving").name)
    return payload


def _table(payload: dict[str, Any]) -> str:
    rows = [[name, r["num_requests"], f"{r['output_tokens_per_s']:.1f}", f"{r['ttft_s']['p50']:.3f}",
             f"{r['ttft_s']['p99']:.3f}"] for name, r in payload["results"].items()]
    return format_table(["engine", "requests", "output tok/s", "TTFT p50 s", "TTFT p99 s"], rows, left=[0])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-shape", default=None, choices=sorted(SHAPES),
                   help="default: llava-1.5-7b; with --smoke, tiny")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--device", default=None, help="None: cuda if there is one, else cpu")
    p.add_argument("--num-requests", type=int, default=500)
    p.add_argument("--hf-requests", type=int, default=64, help="the first K requests run through HF too")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--image-size", type=int, default=336, help="width and height of every image")
    p.add_argument("--text-words", type=int, default=32, help="words of text around each image")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"the CPU, tiny sizes: {_SMOKE}")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--commit", default=None, help="the code's commit, for a copy without git history")
    args = p.parse_args(argv)
    args.model_shape = args.model_shape or ("tiny" if args.smoke else "llava-1.5-7b")
    return args


if __name__ == "__main__":
    main()
