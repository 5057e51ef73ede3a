"""Images in, text out, offline: N chat prompts with one image each through pagellm (`LLM.generate` with
`multi_modal_data`, the model's processor preparing every image), against Hugging Face's batched
`generate` on the first K of the same requests with the same weights, in the same run.

The model is random with a real model's shapes (`--model-shape`, a key of SHAPES), built with
`transformers` from its config classes and saved with a processor (a word-level tokenizer with the
image token, the model's CLIP image processor), so no download is needed; both engines load that
folder. Throughput counts the 128 requested output tokens of every request (EOS ignored); TTFT is
from the batch's start (every request arrives at once) to its first token.

    python -m benchmarks.vlm_serving --out-dir "$OUT" --commit SHA     # one GPU, LLaVA-1.5-7B shapes
    python -m benchmarks.vlm_serving --smoke                          # the CPU, a tiny LLaVA

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
import transformers
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, summarize, write_json

SHAPES: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": {
        "text": dict(vocab_size=32064, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096),
        "vision": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=336, patch_size=14, projection_dim=768),
        "image_token_index": 32000,
    },
    "tiny": {  # tests/test_llava.py's shapes
        "text": dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512),
        "vision": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                       image_size=32, patch_size=8),
        "image_token_index": 127,
    },
}
"""Model shapes by name: the language model's LlamaConfig, the CLIP tower's, and the image token."""
_SMOKE = {"model_shape": "tiny", "num_requests": 8, "hf_requests": 4, "hf_batch_size": 2, "output_len": 8,
          "image_size": 32, "text_words": 8, "dtype": "float32", "device": "cpu", "max_model_len": 256}


def build_model(shape: str, folder: Path, dtype: torch.dtype, device: str) -> transformers.LlavaProcessor:
    """A random LlavaForConditionalGeneration of `shape` and its processor, saved to `folder`."""
    spec = SHAPES[shape]
    text = transformers.LlamaConfig(**spec["text"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = transformers.CLIPVisionConfig(**spec["vision"])
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=spec["image_token_index"],
                                      architectures=["LlavaForConditionalGeneration"])
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype: a 7B model in float32 would take 28 GB
    try:
        with torch.device(device):
            model = transformers.LlavaForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder)
    del model
    vocab_size, image_token = spec["text"]["vocab_size"], spec["image_token_index"]
    vocab = {f"t{i}": i for i in range(3, vocab_size) if i != image_token}
    vocab |= {"<unk>": 0, "<s>": 1, "</s>": 2, "<image>": image_token}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                                     unk_token="<unk>", pad_token="<unk>",
                                                     extra_special_tokens=["<image>"], padding_side="left")
    size = spec["vision"]["image_size"]
    images = transformers.CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer,
                                            patch_size=spec["vision"]["patch_size"],
                                            vision_feature_select_strategy="default", num_additional_image_tokens=1)
    processor.save_pretrained(folder)
    return processor


def requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Prompts of `text_words` random words around one random image each (all distinct)."""
    rng = np.random.default_rng(args.seed)
    vocab = SHAPES[args.model_shape]["text"]["vocab_size"]
    image_token = SHAPES[args.model_shape]["image_token_index"]
    out = []
    for _ in range(args.num_requests):
        words = [f"t{w}" for w in rng.integers(3, min(vocab, image_token), args.text_words)]
        half = len(words) // 2
        pixels = rng.integers(0, 256, (args.image_size, args.image_size, 3), dtype=np.uint8)
        out.append({"prompt": " ".join([*words[:half], "<image>", *words[half:]]),
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
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.tokenizer.padding_side = "left"
    prompts = requests(args)[:args.hf_requests]

    def generate(batch: list[dict[str, Any]], new_tokens: int) -> None:
        inputs = processor(text=[p["prompt"] for p in batch], images=[p["multi_modal_data"]["image"] for p in batch],
                           padding=True, return_tensors="pt").to(device)
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
    p.add_argument("--model-shape", default="llava-1.5-7b", choices=sorted(SHAPES))
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
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
