"""benchmarks/bench_serving.py: HTTP against offline on the same requests, with a model that has no
tokenizer (dummy weights), whose streams then carry every step's tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.bench_serving import main

pytestmark = pytest.mark.slow  # a `pagellm serve` (of a tiny model) and the benchmark client

REQUESTS = str(Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "sharegpt_1000_seed0.json.gz")
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 49152,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
}
"""SmolLM2's vocabulary size, so the ShareGPT sample's token ids are valid."""


def test_sharegpt_sample_through_http_and_offline(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    # main raises unless the HTTP run returns every requested token.
    payload = main(["--model", str(tmp_path), "--load-format", "dummy", "--dtype", "float32", "--num-prompts", "3",
                    "--requests", REQUESTS, "--max-num-seqs", "4", "--no-save"])
    http, offline = payload["http"], payload["offline"]
    assert http["output_tokens"] == offline["output_tokens"] == 335 + 197 + 358
    assert http["ttft_s"]["count"] == 3 and http["e2e_s"]["p99"] >= http["ttft_s"]["p99"]
    # Without a tokenizer there is no text to wait for: events come per step, not one at the end.
    assert http["events_per_stream"] > 10
