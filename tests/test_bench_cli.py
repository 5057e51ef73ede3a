"""`pagellm bench throughput|latency` on the CPU with a tiny dummy model: the numbers agree with each other."""
from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time

import pytest

from engine_utils import assert_no_leak
from pagellm import LLM
from pagellm.benchmarks.datasets import random_requests
from pagellm.benchmarks.runner import run_requests
from pagellm.benchmarks.throughput import throughput_numbers
from pagellm.cli import main as cli_main

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
}
"""SmolLM2's vocabulary size, so the stand-in tokenizer's ShareGPT ids are valid for it."""


TINY_KV_BYTES = 16 << 20


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny dummy Llama with no tokenizer: a folder holding only config.json."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(folder)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir) -> list[str]:
    """The bench flags that run the tiny model on the CPU."""
    return ["--model", tiny_model_dir, "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory-bytes", str(TINY_KV_BYTES), "--disable-tqdm"]


def _bench(args: list[str], tmp_path, capsys) -> tuple[dict, str]:
    path = tmp_path / "result.json"
    assert cli_main(["bench", *args, "--output-json", str(path)]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def _check_metadata(payload: dict) -> None:
    # The command is this process's own command line (pytest's here), so a run can be reproduced.
    assert payload["git"]["commit"] and payload["date_utc"] and payload["command"] == shlex.join(sys.orig_argv)
    assert payload["hardware"]["logical_cores"] >= 1


def test_throughput_random(tiny_model, tmp_path, capsys):
    payload, out = _bench(["throughput", *tiny_model, "--num-prompts", "6", "--input-len", "40",
                           "--output-len", "5", "--max-num-seqs", "2"], tmp_path, capsys)
    _check_metadata(payload)
    r = payload["results"]
    assert r["complete"] and r["num_requests"] == r["num_finished_requests"] == 6
    assert r["output_tokens"] == 6 * 5  # EOS ignored: exactly the asked-for lengths
    assert r["prompt_tokens"] == 6 * 40
    assert r["total_tokens"] == r["prompt_tokens"] + r["output_tokens"]
    assert r["requests_per_s"] == pytest.approx(6 / r["elapsed_s"])
    assert r["output_tokens_per_s"] == pytest.approx(30 / r["elapsed_s"])
    assert r["total_tokens_per_s"] == pytest.approx(r["total_tokens"] / r["elapsed_s"])
    # --max-num-seqs reached the engine: at most 2 requests at a time take >= 3 waves of 5 steps.
    assert payload["engine"]["max_num_seqs"] == 2 and r["num_steps"] >= 15
    assert payload["engine_args"]["load_format"] == "dummy"
    assert (f"Throughput: {r['requests_per_s']:.2f} requests/s, {r['total_tokens_per_s']:.2f} total tokens/s, "
            f"{r['output_tokens_per_s']:.2f} output tokens/s") in out


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory) -> str:
    """A small file in ShareGPT's format (the package's real one has answers of up to ~2,000 tokens)."""
    words = "the quick brown fox jumps over a lazy dog while it rains".split()
    conversations = [{"id": str(i), "conversations": [
        {"from": "human", "value": " ".join(words[:4 + i])}, {"from": "gpt", "value": " ".join(words[i:])}]}
        for i in range(4)]
    path = tmp_path_factory.mktemp("sharegpt") / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    return str(path)


@pytest.mark.slow
def test_throughput_sharegpt_with_a_stand_in_tokenizer(tiny_model, sharegpt_file, smollm2_path, tmp_path, capsys):
    from pagellm.benchmarks.datasets import sharegpt_requests
    from pagellm.loader import resolve_model
    from pagellm.tokenizer import load_tokenizer

    payload, _ = _bench(["throughput", *tiny_model, "--dataset", "sharegpt", "--dataset-path", sharegpt_file,
                         "--num-prompts", "3"], tmp_path, capsys)
    r, dataset = payload["results"], payload["dataset"]
    assert dataset["tokenizer"]["stand_in"] and dataset["tokenizer"]["name"] == smollm2_path
    # Output lengths are the reference answers' token counts (SmolLM2's), all produced with EOS ignored.
    expected = sharegpt_requests(3, load_tokenizer(resolve_model(smollm2_path)), seed=0, path=sharegpt_file)
    assert r["output_tokens"] == dataset["total_output_tokens"] == sum(n for _, n in expected)
    assert r["prompt_tokens"] == dataset["total_prompt_tokens"] == sum(len(p) for p, _ in expected)


def test_latency(tiny_model, tmp_path, capsys):
    iters, output_len = 2, 4
    payload, out = _bench(["latency", *tiny_model, "--batch-sizes", "1", "3", "--input-len", "8",
                           "--output-len", str(output_len), "--num-iters", str(iters), "--num-iters-warmup", "1"],
                          tmp_path, capsys)
    _check_metadata(payload)
    assert [r["batch_size"] for r in payload["results"]] == [1, 3]
    for r in payload["results"]:
        batch = r["batch_size"]
        tpot, ttft, e2e = r["time_per_output_token_s"], r["time_to_first_token_s"], r["end_to_end_s"]
        assert tpot["count"] == iters * batch * (output_len - 1)
        assert ttft["count"] == iters * batch and e2e["count"] == iters
        for stats in (tpot, ttft, e2e):
            assert 0 < stats["p50"] <= stats["p99"]
        # Each request's first token plus its gaps is its last token's time, within its batch's time.
        assert ttft["mean"] + (output_len - 1) * tpot["mean"] <= e2e["mean"] * (1 + 1e-9)
        assert r["output_tokens_per_s"] == pytest.approx(batch * output_len / e2e["mean"])
    assert out.splitlines()[0].split()[:3] == ["batch", "TPOT", "mean"]


@pytest.mark.parametrize("args, message", [
    (["latency", "--output-len", "1"], "--output-len"),
    # The tiny model has no tokenizer: SmolLM2's (the real GGUF) stands in for it.
    pytest.param(["throughput", "--dataset", "sharegpt", "--dataset-path", "SHAREGPT", "--num-prompts", "5"],
                 "fewer than 5 (--num-prompts)", marks=pytest.mark.slow),
])
def test_invalid_flags_are_errors_naming_them(args, message, tiny_model, sharegpt_file, capsys):
    args = [sharegpt_file if a == "SHAREGPT" else a for a in args]
    assert cli_main(["bench", *args, *tiny_model]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # a Python process of its own (imports torch): seconds
def test_installed_command_runs_outside_the_repository(tiny_model, tmp_path):
    """The console script needs nothing from the repository's `benchmarks/` folder."""
    path = tmp_path / "result.json"
    bench = os.path.join(os.path.dirname(sys.executable), "pagellm")
    done = subprocess.run([bench, "bench", "throughput", *tiny_model, "--num-prompts", "2", "--input-len", "8",
                           "--output-len", "3", "--output-json", str(path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(path.read_text())["results"]
    assert result["output_tokens"] == 6 and math.isfinite(result["output_tokens_per_s"])


def test_run_requests_stops_at_the_deadline_and_frees_everything(tiny_model_dir):
    llm = LLM(tiny_model_dir, load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_bytes=TINY_KV_BYTES)
    requests = random_requests(3, 12, 4, TINY_LLAMA["vocab_size"], seed=5)
    late = run_requests(llm.llm_engine, requests, deadline=time.perf_counter())
    assert not late.complete and late.num_steps == 0 and late.output_tokens == 0
    assert throughput_numbers(late)["requests_per_s"] == 0.0
    assert_no_leak(llm.llm_engine)

    timed = run_requests(llm.llm_engine, requests, token_times=True)
    assert timed.complete and [t.output_tokens for t in timed.requests] == [4, 4, 4]
    assert all(t.finished and len(t.token_gaps_s) == 3 and t.first_token_s > 0 for t in timed.requests)
    assert_no_leak(llm.llm_engine)
