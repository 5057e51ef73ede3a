"""Tensor, pipeline and data parallel on a machine of several GPUs, against one GPU in the same run.

Phases (each capped in time; a failed one is recorded and the rest still run):
- `tp_check`: a random Llama saved as safetensors (so every split loads the same values), greedy
  with logprobs at TP=1 and TP=2 (CUDA graphs with the all-reduces inside): tokens, and the
  largest logprob gap where they agree.
- `decode`: Llama-3.1-8B shapes, dummy weights: batch-1 and batch-64 decode, output tokens/s, for
  TP=1 in-process (uni), TP=1 in its own process (mp: the process boundary alone), TP=2, PP=2.
- `data_parallel`: the same batch of requests through AsyncLLM with one and with two replicas.

    python3 -m benchmarks.distributed_gpu            # on nvidia-h200-x2
    .venv/bin/python -m benchmarks.distributed_gpu --smoke   # tiny sizes on the CPU (ranks share it)
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.phases import PhaseRunner
from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.engine.async_llm import AsyncLLM


@dataclasses.dataclass
class Sizes:
    model: str
    device: str
    dtype: str
    max_model_len: int
    input_len: int
    output_len: int
    batch: int
    check_tokens: int
    extra: dict


GPU = Sizes("meta-llama/Llama-3.1-8B-Instruct", "cuda", "bfloat16", 2048, 128, 256, 64, 32,
            {"max_num_seqs": 64})
SMOKE = Sizes("meta-llama/Llama-3.1-8B-Instruct", "cpu", "float32", 256, 8, 4, 2, 8,
              {"max_num_seqs": 4, "kv_cache_memory_bytes": 1 << 26})
"""--smoke: the 8B preset would not fit a CPU run's time, so its config is shrunk (see _smoke_model)."""


def _prompts(n: int, length: int, vocab: int = 30000) -> list[dict]:
    return [{"prompt_token_ids": [(97 * i + 13 * j) % vocab + 100 for j in range(length)]} for i in range(n)]


def _llm(model: str, sizes: Sizes, **kwargs) -> LLM:
    return LLM(model, **{"device": sizes.device, "dtype": sizes.dtype, "max_model_len": sizes.max_model_len,
                         **sizes.extra, **kwargs})


def _save_random_llama(path: Path, sizes: Sizes) -> str:
    """A random Llama (8 heads, 4 KV heads) as safetensors plus a word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=sizes.max_model_len,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(4096)}, unk_token="t0")).save(str(path / "tokenizer.json"))
    return str(path)


def tp_check(sizes: Sizes, tmp: Path) -> dict:
    model = _save_random_llama(tmp / "random-llama", sizes)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.check_tokens, logprobs=5, ignore_eos=True)
    prompts = _prompts(8, 24, vocab=3900)
    runs = {}
    for tp in (1, 2):
        # In processes of their own (mp, also for TP=1): this process stays clean for `decode`'s
        # in-process run (an earlier in-process engine here slowed its batch-1 steps by 40%).
        llm = _llm(model, sizes, dtype="float32", tensor_parallel_size=tp, distributed_executor_backend="mp")
        try:
            runs[tp] = llm.generate(prompts, params, use_tqdm=False)
        finally:
            llm.llm_engine.shutdown()
            del llm
            _free_gpu_cache()
    diverged, max_gap = [], 0.0
    for i, (a, b) in enumerate(zip(runs[1], runs[2])):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        same = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        if same < len(ta):
            diverged.append({"prompt": i, "step": same})
        for k in range(same):
            la, lb = a.outputs[0].logprobs[k], b.outputs[0].logprobs[k]
            max_gap = max(max_gap, abs(la[ta[k]].logprob - lb[tb[k]].logprob))
    return {"tokens_equal": not diverged, "diverged": diverged, "max_logprob_gap": max_gap}


def _decode(llm: LLM, batch: int, sizes: Sizes) -> float:
    prompts = _prompts(batch, sizes.input_len)
    # The same shapes first: Triton compiles a kernel variant on its first use.
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * sizes.output_len / (time.perf_counter() - start)


def _free_gpu_cache() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def decode(sizes: Sizes, model: str, load_format: str) -> dict:
    splits = {"tp1_uni": {}, "tp1_mp": {"distributed_executor_backend": "mp"},
              "tp2": {"tensor_parallel_size": 2}, "tp2_eager": {"tensor_parallel_size": 2, "enforce_eager": True},
              "pp2": {"pipeline_parallel_size": 2}}
    results = {}
    for name, split in splits.items():
        start = time.perf_counter()
        llm = _llm(model, sizes, load_format=load_format, **split)
        try:
            results[name] = {"startup_s": time.perf_counter() - start,
                             "batch_1_tok_s": _decode(llm, 1, sizes),
                             f"batch_{sizes.batch}_tok_s": _decode(llm, sizes.batch, sizes)}
        finally:
            llm.llm_engine.shutdown()
            del llm
            _free_gpu_cache()  # an in-process (uni) rank's weights and cache go back before the next split
        print(name, results[name], flush=True)
    return results


def data_parallel(sizes: Sizes, model: str, load_format: str) -> dict:
    prompts = _prompts(4 * sizes.batch, sizes.input_len)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)

    async def run(llm: AsyncLLM) -> float:
        async def one(i: int, prompt: dict) -> None:
            async for _ in llm.generate(prompt, params, str(i)):
                pass
        start = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return len(prompts) * sizes.output_len / (time.perf_counter() - start)

    results = {}
    for dp in (1, 2):
        args = EngineArgs(model, load_format=load_format, device=sizes.device, dtype=sizes.dtype,
                          max_model_len=sizes.max_model_len, data_parallel_size=dp, **sizes.extra)
        llm = AsyncLLM.from_engine_args(args)
        try:
            asyncio.run(run(llm))  # warm-up: the first requests compile and settle
            results[f"dp{dp}_tok_s"] = asyncio.run(run(llm))
        finally:
            llm.shutdown()
    results["dp2_over_dp1"] = results["dp2_tok_s"] / results["dp1_tok_s"]
    return results


def _smoke_model(tmp: Path) -> str:
    """A 4-layer, 8-head shrink of the 8B config, as a dummy-weights folder (config.json only)."""
    import json

    from pagellm.loader.presets import PRESETS

    config = dict(PRESETS["meta-llama/Llama-3.1-8B-Instruct"], hidden_size=256, intermediate_size=512,
                  num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=32000)
    folder = tmp / "smoke-8b-shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sizes = SMOKE if args.smoke else GPU
    runner = PhaseRunner(args.budget_s, {"tp_check": 150.0, "decode": 300.0, "data_parallel": 180.0})
    with tempfile.TemporaryDirectory() as tmp:
        model = _smoke_model(Path(tmp)) if args.smoke else sizes.model
        runner.run("tp_check", lambda deadline: tp_check(sizes, Path(tmp)))
        runner.run("decode", lambda deadline: decode(sizes, model, "dummy"))
        runner.run("data_parallel", lambda deadline: data_parallel(sizes, model, "dummy"))
    if runner.ok("decode"):
        d = runner.records["decode"]["result"]
        base = d["tp1_uni"]
        rows = [[name, f"{r['batch_1_tok_s']:.1f}", f"{r['batch_1_tok_s'] / base['batch_1_tok_s']:.2f}",
                 f"{r[f'batch_{sizes.batch}_tok_s']:.0f}",
                 f"{r[f'batch_{sizes.batch}_tok_s'] / base[f'batch_{sizes.batch}_tok_s']:.2f}"] for name, r in d.items()]
        print(format_table(["split", "batch-1 tok/s", "x tp1", f"batch-{sizes.batch} tok/s", "x tp1"], rows))
    path = write_json({"metadata": run_metadata(), "sizes": dataclasses.asdict(sizes), "phases": runner.records},
                      args.out or default_result_path("distributed_gpu"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
