"""How the engine sizes its KV cache on a GPU, measured: the data `pagellm plan` is calibrated on.

For each configuration, in a fresh process (as the engine core is): load the dummy model, then
record what `Worker.determine_num_blocks` works from (total memory, weights, the profiled peak of
the largest step, memory outside PyTorch) and what it decides (KV blocks), then allocate the cache
and capture the CUDA graphs and record what the graphs took on top.

On the GPU machine, from the repository root:
    python3 -m benchmarks.kv_sizing_gpu --out "$OUT/kv_sizing.json" --commit SHA
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

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16",
}
"""SmolLM2-135M's published config.json (what the embedded GGUF file holds), for a small-model point."""

# (model, max_num_batched_tokens, max_num_seqs, max_model_len): the reference run first, then one
# knob at a time, so the activation peak can be told apart from the fixed costs.
CONFIGS: list[tuple[str, int, int, int]] = [
    ("meta-llama/Llama-3.1-8B-Instruct", 8192, 256, 4096),
    ("meta-llama/Llama-3.1-8B-Instruct", 8192, 384, 4096),
    ("meta-llama/Llama-3.1-8B-Instruct", 8192, 1024, 4096),
    ("meta-llama/Llama-3.1-8B-Instruct", 8192, 64, 4096),
    ("meta-llama/Llama-3.1-8B-Instruct", 2048, 256, 4096),
    ("meta-llama/Llama-3.1-8B-Instruct", 16384, 256, 4096),
    ("meta-llama/Llama-3.1-8B-Instruct", 32768, 64, 4096),
    ("meta-llama/Llama-3.1-8B-Instruct", 8192, 256, 131072),
    ("qwen2.5-7b", 8192, 256, 4096),
    ("qwen3-8b", 8192, 256, 4096),
    ("smollm2-135m", 8192, 256, 4096),
]


def measure(model: str, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> dict[str, Any]:
    """One configuration, in this process (call it in a fresh one)."""
    import torch

    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.worker.worker import Worker

    args = EngineArgs(model=model, load_format="dummy", dtype="bfloat16", max_model_len=max_model_len,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                      gpu_memory_utilization=0.9)
    worker = Worker(args.create_engine_config())
    device = worker.config.device
    worker.load_model()
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)
    peak = worker.runner.profile_peak_memory()
    free, total = torch.cuda.mem_get_info(device)
    not_torch = (total - free) - torch.cuda.memory_reserved(device)
    num_blocks = worker.determine_num_blocks()
    block_bytes = worker.runner.kv_bytes_per_block()
    reserved_before = torch.cuda.memory_reserved(device)
    worker.initialize_kv_cache(num_blocks)
    torch.cuda.synchronize(device)
    reserved_after = torch.cuda.memory_reserved(device)
    free_after, _ = torch.cuda.mem_get_info(device)
    return {
        "model": model, "max_num_batched_tokens": max_num_batched_tokens, "max_num_seqs": max_num_seqs,
        "max_model_len": max_model_len, "gpu_memory_utilization": 0.9, "dtype": "bfloat16",
        "total_bytes": total, "weights_allocated_bytes": weights,
        "profiled_peak_bytes": peak, "activation_peak_bytes": peak - weights, "not_torch_bytes": not_torch,
        "kv_bytes_per_block": block_bytes, "num_kv_blocks": num_blocks,
        "cuda_graph_bytes": reserved_after - reserved_before - num_blocks * block_bytes,
        "used_fraction_after_startup": (total - free_after) / total,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--commit", default=None, help="the commit the code came from (no .git on the GPU machine)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process's configuration
    ns = parser.parse_args(argv)
    if ns.one is not None:
        model, tokens, seqs, max_len = json.loads(ns.one)
        print(json.dumps(measure(model, tokens, seqs, max_len)))
        return

    from pagellm.benchmarks.results import run_metadata, write_json

    runs = []
    with tempfile.TemporaryDirectory() as folder:
        small = Path(folder) / "smollm2-135m"
        small.mkdir()
        (small / "config.json").write_text(json.dumps(SMOLLM2_135M))
        for model, tokens, seqs, max_len in CONFIGS:
            path = str(small) if model == "smollm2-135m" else model
            child = subprocess.run([sys.executable, "-m", "benchmarks.kv_sizing_gpu", "--out", ns.out,
                                    "--one", json.dumps([path, tokens, seqs, max_len])],
                                   capture_output=True, text=True, timeout=240)
            if child.returncode != 0:
                runs.append({"model": model, "error": child.stderr[-3000:]})
            else:
                runs.append({**json.loads(child.stdout.strip().splitlines()[-1]), "model": model})
            print(json.dumps(runs[-1]), flush=True)
    payload = {"benchmark": "kv_sizing_gpu", **run_metadata(ns.commit), "runs": runs}
    print("wrote", write_json(payload, ns.out))


if __name__ == "__main__":
    main()
