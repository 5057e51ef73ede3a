"""One GPU, the engine core with the `torch` attention backend: memory accounting and baseline speed.

1. Llama-3.1-8B shapes with dummy bf16 weights: the KV cache sized from `gpu_memory_utilization`
   (the memory actually in use afterwards, as a fraction of the card), start-up time.
2. Throughput on random prompts (--num-prompts x --input-len in / --output-len out, EOS ignored),
   and batch-1 decode speed, against Hugging Face `generate` on the same prompts and weights'
   shapes in the same run (HF gets random weights too; speed does not depend on their values).

Run on the GPU machine from the repository root:
    python3 -m benchmarks.gpu_engine_check --out-dir "$OUT"
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.datasets import random_requests
from pagellm import LLM, SamplingParams

def run_engine(args: argparse.Namespace) -> tuple[dict[str, Any], list]:
    torch.cuda.empty_cache()
    start = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", device="cuda",
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)
    startup_s = time.perf_counter() - start
    free, total = torch.cuda.mem_get_info()
    core = llm.llm_engine.engine_core
    result: dict[str, Any] = {
        "startup_s": startup_s,
        "num_kv_blocks": core.num_blocks,
        "kv_tokens": core.num_blocks * llm.llm_engine.config.args.block_size,
        "gpu_memory_used_fraction": (total - free) / total,
        "gpu_memory_utilization_requested": args.gpu_memory_utilization,
        "gpu_total_gib": total / 2**30,
    }
    vocab = llm.llm_engine.config.source.arch.vocab_size
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, vocab, seed=0)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["throughput"] = {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / elapsed,
                            "requests_per_s": len(outs) / elapsed}
    one = SamplingParams(temperature=0.0, max_tokens=args.batch1_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts[:1], one, use_tqdm=False)
    result["batch1_output_tok_per_s"] = args.batch1_tokens / (time.perf_counter() - start)
    result["sampling_features"] = check_sampling_features(llm, prompts[:8])
    result["no_leak"] = core.scheduler.kv.pool.num_free_blocks == core.num_blocks
    del llm, core
    gc.collect()
    torch.cuda.empty_cache()
    return result, requests


def check_sampling_features(llm: LLM, prompts: list) -> dict[str, Any]:
    """Every device-side sampling feature at once on the GPU: the step must run and return what was asked."""
    params = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, presence_penalty=0.5,
                            frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={11: 5.0}, seed=3,
                            min_tokens=4, max_tokens=16, logprobs=5, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    ok = all(len(o.outputs) == 2 and all(len(c.token_ids) == 16 and len(c.logprobs) == 16 for c in o.outputs)
             and len(o.prompt_logprobs) == len(o.prompt_token_ids) for o in outs)
    greedy_with_bias = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={11: 100.0},
                                                                 ignore_eos=True), use_tqdm=False)
    return {"all_outputs_complete": ok, "logit_bias_forces_token": greedy_with_bias[0].outputs[0].token_ids == [11] * 4}


def run_hf(args: argparse.Namespace, requests: list) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.hf_baseline import run_hf_generate
    from pagellm.loader import PRESETS

    preset = dict(PRESETS[args.model])
    config = AutoConfig.for_model(preset.pop("model_type"), **preset)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    run_hf_generate(model, requests[:2], 2)  # warm-up
    torch.cuda.synchronize()
    res = run_hf_generate(model, requests, args.hf_batch_size)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"elapsed_s": res.elapsed_s, "output_tokens": res.output_tokens,
            "output_tok_per_s": res.output_tokens_per_s, "batch_size": args.hf_batch_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--batch1-tokens", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--hf-batch-size", type=int, default=256)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--out-dir", default=None)
    args = p.parse_args()
    payload: dict[str, Any] = {"benchmark": "gpu_engine_check", **run_metadata(), "parameters": vars(args)}
    payload["pagellm"], requests = run_engine(args)
    print("pagellm:", payload["pagellm"], flush=True)
    if not args.skip_hf:
        payload["hf"] = run_hf(args, requests)
        payload["ratio_vs_hf"] = payload["pagellm"]["throughput"]["output_tok_per_s"] / payload["hf"]["output_tok_per_s"]
    rows = [["pagellm (torch backend)", f"{payload['pagellm']['throughput']['output_tok_per_s']:.0f}",
             f"{payload['pagellm']['batch1_output_tok_per_s']:.1f}"]]
    if "hf" in payload:
        rows.append(["hf generate", f"{payload['hf']['output_tok_per_s']:.0f}", "-"])
    print(format_table(["system", "output tok/s (batch)", "batch-1 tok/s"], rows))
    path = Path(args.out_dir) / default_result_path("gpu_engine_check").name if args.out_dir else default_result_path("gpu_engine_check")
    print("wrote", write_json(payload, path))


if __name__ == "__main__":
    main()
