"""`--tokenizer`: a tokenizer other than the model's own (text prompts for dummy weights, which have none)."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig

from pagellm import LLM, SamplingParams

VOCAB = 64
ENGINE = {"load_format": "dummy", "device": "cpu", "max_model_len": 64, "kv_cache_memory_bytes": 1 << 22}


def _word_tokenizer(folder: Path, size: int) -> str:
    """A word-level tokenizer.json whose token i is "t{i}"."""
    folder.mkdir()
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny Llama's config.json alone: dummy weights and no tokenizer."""
    folder = tmp_path_factory.mktemp("tiny")
    LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64,
                architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return str(folder)


def test_text_prompts_through_the_given_tokenizer(model_dir: str, tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    with_tokenizer = LLM(model=model_dir, tokenizer=_word_tokenizer(tmp_path / "tok", VOCAB), **ENGINE)
    out = with_tokenizer.generate(["t5 t7 t9"], params)[0]
    assert out.prompt_token_ids == [5, 7, 9]
    # The same weights fed the ids themselves, with no tokenizer at all, continue the same way.
    ids_only = LLM(model=model_dir, **ENGINE)
    with pytest.raises(ValueError, match="has no tokenizer"):
        ids_only.generate(["t5 t7 t9"], params)
    reference = ids_only.generate([{"prompt_token_ids": [5, 7, 9]}], params)[0].outputs[0].token_ids
    assert out.outputs[0].token_ids == reference
    assert out.outputs[0].text.split() == [f"t{i}" for i in reference]


def test_a_tokenizer_that_does_not_fit_is_refused(model_dir: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--tokenizer.* 100 tokens, more than the model's vocab_size 64"):
        LLM(model=model_dir, tokenizer=_word_tokenizer(tmp_path / "big", 100), **ENGINE)
    with pytest.raises(ValueError, match=r"--tokenizer.*neither a \.gguf file nor a directory"):
        LLM(model=model_dir, tokenizer=str(tmp_path / "missing"), **ENGINE)
