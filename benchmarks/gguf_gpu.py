"""GGUF weights kept quantized on one GPU: the kernel per block type, real weights against Hugging
Face, and an 8B-shaped file against bf16, in one run.

Phases (each optional, `--phases`; a failure is recorded and the rest still run):
  kernels    per block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K; random blocks) and Llama-8B projection
             shape, M rows: the Triton kernel on the type's grouped layout against bf16 `F.linear`
             (cuBLAS) on the same shape; error against float32 dequantize-then-matmul; at M = 1 the
             fraction of the measured copy bandwidth its bytes reach
  smollm2    the real SmolLM2-135M file (--smollm2, Q4_1 layers, Q8_0 table): float32 greedy tokens
             with the blocks kept (gguf) and dequantized at load (none) against Hugging Face
             transformers on the same file; then bf16 batch-1 decode of both
  half       the real file, one sequence at a time, blocks kept (gguf: Q4_1, groups of 32 with offsets) and rtn
             (groups of 64): bfloat16 greedy tokens and their log-probabilities with the one-row tiles limited to
             the float16 ones (HALF) against those limited to float32 products; for gguf both also against
             float32 activations
  synthetic  a Llama-3.1-8B-shaped file written here with Q4_K_M's mix (Q4_K; Q6_K for attn_v,
             ffn_down and output), random blocks, a placeholder vocabulary of the same size, no
             llama3 rope scaling: batch-1 decode against the bf16 dummy-weight llama-3.1-8b preset

On the GPU machine, from the repository root:
    python3 -m benchmarks.gguf_gpu --smollm2 FILE --out-dir "$OUT" --commit SHA
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.quant_gpu import SHAPES, bench_us
from pagellm import LLM, SamplingParams
from pagellm.benchmarks.latency import measure_latency
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.roofline import measure_ceilings
from pagellm.benchmarks.runner import engine_summary
from pagellm.loader.presets import get_preset
from pagellm.quantization import gguf_blocks
from pagellm.ops.triton import one_row_tiles
from pagellm.ops.triton import matmul as triton_matmul
from pagellm.tokenizer.gguf_tokenizer import byte_to_unicode

TYPE_NAMES = {gguf_blocks.Q4_0: "Q4_0", gguf_blocks.Q4_1: "Q4_1", gguf_blocks.Q5_0: "Q5_0", gguf_blocks.Q5_1: "Q5_1",
              gguf_blocks.Q8_0: "Q8_0", gguf_blocks.Q2_K: "Q2_K", gguf_blocks.Q3_K: "Q3_K", gguf_blocks.Q4_K: "Q4_K",
              gguf_blocks.Q5_K: "Q5_K", gguf_blocks.Q6_K: "Q6_K"}
_FP16_FIELDS = {  # byte offset of each float16 field in a block -> the range its random values take
    gguf_blocks.Q4_0: {0: (2e-3, 6e-3)},
    gguf_blocks.Q4_1: {0: (2e-3, 6e-3), 2: (-5e-2, -2e-2)},
    gguf_blocks.Q5_0: {0: (1e-3, 3e-3)},
    gguf_blocks.Q5_1: {0: (1e-3, 3e-3), 2: (-5e-2, -2e-2)},
    gguf_blocks.Q8_0: {0: (2e-4, 5e-4)},
    gguf_blocks.Q2_K: {80: (1e-3, 3e-3), 82: (0.0, 3e-3)},
    gguf_blocks.Q3_K: {108: (1e-4, 3e-4)},
    gguf_blocks.Q4_K: {0: (5e-5, 1.5e-4), 2: (0.0, 1.5e-4)},
    gguf_blocks.Q5_K: {0: (3e-5, 7e-5), 2: (0.0, 1.5e-4)},
    gguf_blocks.Q6_K: {208: (1e-5, 3e-5)},
}
"""Random codes under these scales give weights of a few hundredths, like a trained model's."""
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three laws of thermodynamics are", "To make a cup of tea, first",
           "In 1969, the first humans to walk on the moon", "The difference between a list and a tuple in Python",
           "Photosynthesis is the process by which"]


def random_blocks(qtype: int, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, bytes per row] of `qtype` blocks: random codes (and sub-block scales), float16
    fields drawn from `_FP16_FIELDS`."""
    values, nbytes = gguf_blocks.BLOCKS[qtype]
    blocks = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for offset, (low, high) in _FP16_FIELDS[qtype].items():
        field = rng.uniform(low, high, (rows, cols // values, 1)).astype(np.float16)
        blocks[..., offset:offset + 2] = field.view(np.uint8)
    return blocks.reshape(rows, -1)


def kernel_phase(rows_list: list[int]) -> list[dict[str, Any]]:
    from pagellm.ops.triton.matmul import dequant_matmul

    records = []
    rng = np.random.default_rng(0)
    for name, (n, k) in SHAPES.items():
        w16 = (torch.randn(n, k, device="cuda") * 0.02).bfloat16()
        xs = {rows: torch.randn(rows, k, device="cuda").bfloat16() for rows in rows_list}
        bf16_us = {rows: bench_us(lambda x=x: F.linear(x, w16)) for rows, x in xs.items()}
        for qtype, type_name in TYPE_NAMES.items():
            g = gguf_blocks.to_grouped(qtype, torch.from_numpy(random_blocks(qtype, n, k, rng)).cuda(), k)
            reference = gguf_blocks.dequantize(g)
            weight_bytes = sum(t.numel() * t.element_size() for t in (g.codes, g.scale, g.offset) if t is not None)
            for rows, x in xs.items():
                record = {"layer": name, "n": n, "k": k, "rows": rows, "type": type_name, "weight_bytes": weight_bytes,
                          "bf16_us": bf16_us[rows]}
                run = lambda x=x, g=g: dequant_matmul(x, g.codes, g.scale, g.zero, g.group, g.offset)  # noqa: E731
                try:
                    record["us"] = bench_us(run)
                    expected = x.float() @ reference.t()
                    record["max_rel_error"] = ((run().float() - expected).abs().max() / expected.abs().max()).item()
                except Exception as e:  # noqa: BLE001 (recorded, the other cases still run)
                    record["error"] = f"{type(e).__name__}: {e}"[:300]
                records.append(record)
                print(f"{name} {type_name} M={rows}: {record.get('us', float('nan')):.1f} us "
                      f"(bf16 {record['bf16_us']:.1f})", flush=True)
        torch.cuda.empty_cache()
    return records


def _batch1(llm: LLM) -> float:
    latency = measure_latency(llm, 1, 128, 128, 3, 1, 0)
    return 1.0 / latency["time_per_output_token_s"]["mean"]


def _free() -> None:
    """Give back what a dropped engine or model held."""
    gc.collect()
    torch.cuda.empty_cache()


def smollm2_phase(path: str, max_tokens: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    tokens, result = {}, {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for method in ("gguf", "none"):
        llm = LLM(path, dtype="float32", quantization=method)
        outputs = llm.generate(PROMPTS, params)
        prompt_ids = [o.prompt_token_ids for o in outputs]
        tokens[method] = [list(o.outputs[0].token_ids) for o in outputs]
        del llm
        _free()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              torch_dtype=torch.float32).cuda().eval()
    tokens["hf"] = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                              do_sample=False)
            tokens["hf"].append(out[0, len(ids):].tolist())
    del hf
    _free()

    def agreement(a: str, b: str) -> dict[str, Any]:
        first = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p))
                 for p, q in zip(tokens[a], tokens[b])]
        return {"prompts_equal": sum(f == max_tokens for f in first), "prompts": len(first),
                "first_difference": first}

    result["float32_greedy"] = {"gguf_vs_hf": agreement("gguf", "hf"), "none_vs_hf": agreement("none", "hf"),
                                "gguf_vs_none": agreement("gguf", "none")}
    print(f"SmolLM2 float32 greedy: {result['float32_greedy']}", flush=True)
    for method in ("gguf", "none"):
        llm = LLM(path, quantization=method)
        result[f"{method}_batch1_tok_s"] = _batch1(llm)
        result[f"{method}_engine"] = engine_summary(llm)
        print(f"SmolLM2 {method}: batch-1 {result[f'{method}_batch1_tok_s']:.1f} tok/s", flush=True)
        del llm
        _free()
    return result


def half_phase(path: str, max_tokens: int) -> dict[str, Any]:
    """Greedy runs of one sequence at a time (one-row decode steps): per method, bfloat16 with the
    one-row tiles limited to float32 products and to the float16 ones (HALF); for gguf (the same
    blocks at every dtype) also float32 activations, the reference both are held to."""
    real = triton_matmul.one_row_candidates
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    runs: dict[str, list[tuple[list[int], list[float]]]] = {}
    chosen: dict[str, dict[str, str]] = {}

    def run(name: str, method: str, dtype: str, float32_products: bool = False) -> None:
        # the candidates of float32 activations never hold float16 tiles; bfloat16 ones' hold only them
        triton_matmul.one_row_candidates = lambda constants, x_dtype, device: real(
            constants, torch.float32 if float32_products else x_dtype, device)
        one_row_tiles._CHOSEN.clear()  # each engine times its own candidates at start-up
        llm = LLM(path, dtype=dtype, quantization=method, max_num_seqs=1)
        outputs = llm.generate(PROMPTS, params)
        runs[name] = [(list(o.outputs[0].token_ids), [next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs])
                      for o in outputs]
        chosen[name] = {f"{k.n}x{k.k}": str(c) for k, c in one_row_tiles._CHOSEN.items() if k.weight_dtype == torch.int32}
        del llm
        _free()

    def agreement(a: str, b: str) -> dict[str, Any]:
        first = [next((i for i, (x, y) in enumerate(zip(p[0], q[0])) if x != y), max_tokens)
                 for p, q in zip(runs[a], runs[b])]
        diffs = [abs(x - y) for p, q, f in zip(runs[a], runs[b], first) for x, y in zip(p[1][:f], q[1][:f])]
        return {"prompts_equal": sum(f == max_tokens for f in first), "prompts": len(first), "first_difference": first,
                "mean_abs_logprob_diff_while_equal": sum(diffs) / max(len(diffs), 1),
                "max_abs_logprob_diff_while_equal": max(diffs, default=0.0)}

    try:
        for method in ("gguf", "rtn"):
            run(f"{method}_bf16_float32_products", method, "bfloat16", float32_products=True)
            run(f"{method}_bf16_half", method, "bfloat16")
        run("gguf_float32", "gguf", "float32")
    finally:
        triton_matmul.one_row_candidates = real
    result: dict[str, Any] = {"tiles": chosen, "agreement": {
        "gguf_bf16_half_vs_float32_products": agreement("gguf_bf16_half", "gguf_bf16_float32_products"),
        "rtn_bf16_half_vs_float32_products": agreement("rtn_bf16_half", "rtn_bf16_float32_products"),
        "gguf_bf16_float32_products_vs_float32": agreement("gguf_bf16_float32_products", "gguf_float32"),
        "gguf_bf16_half_vs_float32": agreement("gguf_bf16_half", "gguf_float32")}}
    for name, numbers in result["agreement"].items():
        print(f"SmolLM2 {name}: {numbers}", flush=True)
    return result


Q4_K_M = {"attn_q": gguf_blocks.Q4_K, "attn_k": gguf_blocks.Q4_K, "attn_v": gguf_blocks.Q6_K,
          "attn_output": gguf_blocks.Q4_K, "ffn_gate": gguf_blocks.Q4_K, "ffn_up": gguf_blocks.Q4_K,
          "ffn_down": gguf_blocks.Q6_K, "token_embd": gguf_blocks.Q4_K, "output": gguf_blocks.Q6_K}
"""llama.cpp's Q4_K_M mix of block types, by GGUF tensor (its first layers' Q6_K ffn_down aside)."""


def write_synthetic_gguf(path: str, config: dict[str, Any], types: dict[str, int] = Q4_K_M, seed: int = 0) -> None:
    """A Llama of `config`'s shapes (Hugging Face names) as a GGUF file of random `types` blocks,
    float32 norms of ones, a placeholder byte-level vocabulary of the model's size, plain rope."""
    import gguf

    hidden, ffn, heads, kv_heads = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                                         "num_key_value_heads"))
    vocab, head_dim = config["vocab_size"], config.get("head_dim", hidden // heads)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(min(8192, config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta", 1e4))
    writer.add_layer_norm_rms_eps(config.get("rms_norm_eps", 1e-5))
    writer.add_vocab_size(vocab)
    alphabet = list(byte_to_unicode().values())  # every byte a token, then fillers "t0", "t1", ...
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(alphabet + [f"t{i}" for i in range(vocab - len(alphabet))])
    writer.add_token_merges(["t 0"])
    writer.add_eos_token_id(vocab - 1)

    def add(name: str, rows: int, cols: int) -> None:
        qtype = types[name.split(".")[-1]]
        writer.add_tensor(f"{name}.weight", random_blocks(qtype, rows, cols, rng),
                          raw_dtype=gguf.GGMLQuantizationType(qtype))

    ones = np.ones(hidden, dtype=np.float32)
    for i in range(config["num_hidden_layers"]):
        for name, rows, cols in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                 ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, heads * head_dim),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            add(f"blk.{i}.{name}", rows, cols)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    add("token_embd", vocab, hidden)
    add("output", vocab, hidden)
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def synthetic_phase(preset: str) -> dict[str, Any]:
    result: dict[str, Any] = {"preset": preset}
    llm = LLM(preset, load_format="dummy")
    result["bf16_batch1_tok_s"] = _batch1(llm)
    result["bf16_engine"] = engine_summary(llm)
    print(f"{preset} bf16 (dummy): batch-1 {result['bf16_batch1_tok_s']:.1f} tok/s", flush=True)
    del llm
    _free()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "synthetic-q4_k_m.gguf")
        start = time.perf_counter()
        write_synthetic_gguf(path, get_preset(preset)[0])
        result["file_bytes"] = os.path.getsize(path)
        result["write_s"] = time.perf_counter() - start
        start = time.perf_counter()
        llm = LLM(path)
        result["gguf_startup_s"] = time.perf_counter() - start
        result["gguf_engine"] = engine_summary(llm)
        result["gguf_batch1_tok_s"] = _batch1(llm)
        print(f"{preset} Q4_K_M (GGUF kept): batch-1 {result['gguf_batch1_tok_s']:.1f} tok/s", flush=True)
        del llm
        _free()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", nargs="+", default=["kernels", "smollm2", "synthetic"])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256])
    p.add_argument("--smollm2", default=None, help="the SmolLM2-135M-Instruct Q4_1 .gguf file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--commit", default=None)
    args = p.parse_args(argv)
    payload: dict[str, Any] = {"metadata": run_metadata(args.commit), "args": vars(args)}
    payload["ceilings"] = measure_ceilings(torch.device("cuda"), 1 << 30, 8192, torch.bfloat16)[1]
    phases = {"kernels": lambda: kernel_phase(args.rows),
              "smollm2": lambda: smollm2_phase(args.smollm2, args.max_tokens),
              "half": lambda: half_phase(args.smollm2, args.max_tokens),
              "synthetic": lambda: synthetic_phase(args.preset)}
    for name in args.phases:
        try:
            payload[name] = phases[name]()
        except Exception as e:  # noqa: BLE001
            payload[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(name, payload[name], flush=True)
    print(summary(payload))
    out = Path(args.out_dir) / "gguf_gpu.json" if args.out_dir else default_result_path("gguf_gpu")
    write_json(payload, out)
    return payload


def summary(payload: dict[str, Any]) -> str:
    lines = []
    bandwidth = (payload.get("ceilings") or {}).get("copy_bytes_per_s")
    kernels = payload.get("kernels")
    if isinstance(kernels, list):
        rows = []
        for r in kernels:
            if "us" not in r:
                rows.append([r["layer"], r["type"], r["rows"], r.get("error", "")[:40], "", "", ""])
                continue
            frac = f"{r['weight_bytes'] / (r['us'] * 1e-6) / bandwidth:.2f}" if bandwidth and r["rows"] == 1 else ""
            rows.append([r["layer"], r["type"], r["rows"], f"{r['us']:.1f}", f"{r['bf16_us'] / r['us']:.2f}x", frac,
                         f"{r['max_rel_error']:.1e}"])
        lines.append(format_table(["layer", "type", "M", "us", "vs bf16", "of copy bw (M=1)", "max rel err"], rows,
                                  left=[0, 1]))
    small = payload.get("smollm2") or {}
    if "float32_greedy" in small:
        g = small["float32_greedy"]
        lines.append("SmolLM2 float32 greedy, prompts equal over all tokens: " + ", ".join(
            f"{k} {v['prompts_equal']}/{v['prompts']}" for k, v in g.items() if isinstance(v, dict)))
        if "none_batch1_tok_s" in small:
            lines.append(f"SmolLM2 bf16 batch-1: gguf {small['gguf_batch1_tok_s']:.1f} tok/s, dequantized "
                         f"{small['none_batch1_tok_s']:.1f} tok/s")
    synth = payload.get("synthetic") or {}
    if "gguf_batch1_tok_s" in synth:
        blocks = {k: (synth.get(f"{k}_engine") or {}).get("num_kv_blocks") for k in ("gguf", "bf16")}
        lines.append(f"{synth['preset']} batch-1: Q4_K_M kept {synth['gguf_batch1_tok_s']:.1f} tok/s, bf16 "
                     f"{synth['bf16_batch1_tok_s']:.1f} tok/s: "
                     f"{synth['gguf_batch1_tok_s'] / synth['bf16_batch1_tok_s']:.2f}x;"
                     f" KV blocks {blocks['gguf']} vs {blocks['bf16']}")
    return "\n\n".join(lines)


if __name__ == "__main__":
    main()
