"""Our tokenizers against Hugging Face's on the bundled SmolLM2 GGUF, plus HF-directory loading."""
from __future__ import annotations

import json
import re

import pytest
from tokenizers import processors

from pagellm.loader import ModelSource, resolve_model
from pagellm.config.arch import ModelArchConfig
from pagellm.tokenizer import Tokenizer, load_tokenizer
from pagellm.tokenizer.gguf_tokenizer import build_gguf_tokenizer

CORPUS = [
    "Hello world",
    " Hello world",
    "   leading spaces and trailing   ",
    "The quick brown fox jumps over the lazy dog. It's 12:45, isn't it? They'll say we'd've gone.",
    "def fib(n):\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n\n\n",
    "for (int i = 0; i < 10; ++i) {    x += a[i] * 3.14159; }  // comment\r\n",
    "Numbers: 0 7 42 123 2024 1234567890 3.5e-10 -17 +0x1F 1,000,000",
    "中文测试：你好，世界！机器学习很有趣。",
    "日本語とEnglishの混在テキスト",
    "Emoji 😀🎉👍🏽 and ZWJ 👨‍👩‍👧‍👦 flags 🇫🇷",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>glued<|endoftext|>tokens <repo_name> and <|im_start|>",
    "\n\n\nnewlines\n \n\t\tand tabs",
    "Ünïcödé àccents ñ ß ø Ωmega Привет мир",
    "",
    " ",
    "a" * 300,
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: str) -> Tokenizer:
    tok = load_tokenizer(resolve_model(smollm2_path))
    assert tok is not None
    return tok


@pytest.mark.slow
@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_hf(tokenizer: Tokenizer, hf_smollm2_tokenizer, text: str) -> None:
    expected = hf_smollm2_tokenizer(text)["input_ids"]
    assert tokenizer.encode(text) == expected
    assert tokenizer.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_hf(tokenizer: Tokenizer, hf_smollm2_tokenizer, skip: bool) -> None:
    for text in CORPUS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=skip) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.decode(tokenizer.encode(CORPUS[10]), skip_special_tokens=False) == CORPUS[10]
    assert "<|im_start|>" not in tokenizer.decode(tokenizer.encode(CORPUS[10]))


@pytest.mark.slow
def test_special_tokens(tokenizer: Tokenizer, hf_smollm2_tokenizer) -> None:
    assert tokenizer.bos_token_id == hf_smollm2_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == hf_smollm2_tokenizer.eos_token_id == 2
    assert set(hf_smollm2_tokenizer.all_special_ids) <= tokenizer.all_special_ids
    assert tokenizer.all_special_ids == set(range(17))  # every CONTROL token of the file
    assert tokenizer.vocab_size == len(hf_smollm2_tokenizer) == 49152
    assert tokenizer.encode("<|im_start|>") == [1]


@pytest.mark.slow
def test_decode_stream_matches_full_decode(tokenizer: Tokenizer) -> None:
    for text in CORPUS[7:12]:
        ids = tokenizer.encode(text)
        stream = tokenizer.decode_stream()
        chunks = [stream.step(tokenizer.backend, i) for i in ids]
        assert "".join(c for c in chunks if c is not None) == tokenizer.decode(ids)
    # An emoji spans several byte-level tokens: nothing is emitted until it is complete.
    ids = tokenizer.encode("😀")
    assert len(ids) > 1
    stream = tokenizer.decode_stream()
    assert [stream.step(tokenizer.backend, i) for i in ids] == [None] * (len(ids) - 1) + ["😀"]


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Tell me a joke"},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🐔 中文"},
    ],
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_hf(tokenizer: Tokenizer, hf_smollm2_tokenizer, conversation, add_generation_prompt) -> None:
    expected = hf_smollm2_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt) == expected


# Exercises the environment features templates rely on: trim/lstrip blocks, loop controls,
# tojson without ASCII escaping, bos/eos variables, extra kwargs, and a generation block.
CUSTOM_TEMPLATE = """{{ bos_token }}
{% for m in messages %}
  {% if m['role'] == 'skip' %}{% continue %}{% endif %}
  {% generation %}[{{ m['role'] }}] {{ m['content'] | tojson }}{% endgeneration %}
{% endfor %}
{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}<go>{{ eos_token }}{{ greeting }}{% endif %}"""


@pytest.mark.slow
def test_custom_template_matches_hf(tokenizer: Tokenizer, hf_smollm2_tokenizer) -> None:
    conversation = [{"role": "user", "content": "héllo \"q\" 中"}, {"role": "skip", "content": "x"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": "é"}}}]
    ours = tokenizer.apply_chat_template(conversation, chat_template=CUSTOM_TEMPLATE, tools=tools, greeting="hey")
    theirs = hf_smollm2_tokenizer.apply_chat_template(
        conversation, chat_template=CUSTOM_TEMPLATE, tools=tools, greeting="hey", tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs
    assert '"héllo \\"q\\" 中"' in ours and "[skip]" not in ours


@pytest.mark.slow
def test_template_helpers_and_errors(tokenizer: Tokenizer) -> None:
    date = tokenizer.apply_chat_template([], chat_template="{{ strftime_now('%Y-%m-%d') }}")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date)
    with pytest.raises(ValueError, match="roles must alternate"):
        tokenizer.apply_chat_template([], chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="syntax error"):
        tokenizer.apply_chat_template([], chat_template="{% if %}")
    # The sandbox blocks templates from reaching Python internals.
    with pytest.raises(ValueError, match="unsafe"):
        tokenizer.apply_chat_template([], chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    bare = Tokenizer(tokenizer.backend)
    with pytest.raises(ValueError, match="chat_template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_unsupported_gguf_tokenizer_model() -> None:
    with pytest.raises(ValueError, match="'llama' is not supported"):
        build_gguf_tokenizer({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, "x.gguf")


@pytest.mark.slow
def test_gguf_add_bos_eos_flags(smollm2_path: str) -> None:
    from pagellm.loader.gguf_file import GGUFFile

    with GGUFFile(smollm2_path) as gguf:
        metadata = dict(gguf.metadata)
    metadata["tokenizer.ggml.add_bos_token"] = True
    metadata["tokenizer.ggml.add_eos_token"] = True
    backend = build_gguf_tokenizer(metadata, smollm2_path).backend
    plain = backend.encode("Hello", add_special_tokens=False).ids
    assert backend.encode("Hello").ids == [1, *plain, 2]


def _hf_dir_source(path) -> ModelSource:
    arch = ModelArchConfig.from_hf_dict(
        {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 1, "num_attention_heads": 2}
    )
    return ModelSource(str(path), "safetensors", arch, {"eos_token_id": [2, 0]})


@pytest.mark.slow
def test_hf_directory_tokenizer(tokenizer: Tokenizer, tmp_path) -> None:
    tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<|im_start|>", "special": True}, "chat_template": template})
    )
    loaded = load_tokenizer(_hf_dir_source(tmp_path))
    assert loaded is not None
    assert loaded.bos_token_id == 1
    assert loaded.eos_token_id == 2  # not in tokenizer_config: first id of generation_config
    assert loaded.all_special_ids == tokenizer.all_special_ids
    for text in CORPUS:
        assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x"

    # A list of named templates picks "default"; chat_template.jinja takes precedence over both.
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": [{"name": "tool_use", "template": "T"},
                                                                   {"name": "default", "template": "D"}]})
    )
    loaded = load_tokenizer(_hf_dir_source(tmp_path))
    assert loaded.eos_token_id == 0 and loaded.apply_chat_template([]) == "D"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_tokenizer(_hf_dir_source(tmp_path)).apply_chat_template([{"role": "user", "content": ""}]) == "J1"


@pytest.mark.slow
def test_hf_directory_post_processor_adds_bos(tokenizer: Tokenizer, tmp_path) -> None:
    backend = load_tokenizer(resolve_model(None)).backend  # a fresh copy we may modify
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A $B:1", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(_hf_dir_source(tmp_path))
    assert loaded.encode("Hello world") == [1, 19556, 905]
    assert loaded.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert loaded.decode([1, 19556, 905]) == "Hello world"


def test_missing_tokenizer_json(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(_hf_dir_source(tmp_path))
    dummy = _hf_dir_source(tmp_path)
    dummy.load_format = "dummy"
    assert load_tokenizer(dummy) is None
    assert load_tokenizer(resolve_model("qwen3-8b", load_format="dummy")) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pre", "pieces"),
    [
        ("smollm", ["abc", "Ġ12345", "ĊĊ"]),  # GPT-2 pattern, as transformers' conversion uses
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "ĊĊ"]),
        ("llama-bpe", ["abc", "Ġ", "123", "45", "ĊĊ"]),
    ],
)
def test_gguf_pre_tokenizer_patterns(smollm2_path: str, pre: str, pieces: list[str]) -> None:
    from pagellm.loader.gguf_file import GGUFFile

    with GGUFFile(smollm2_path) as gguf:
        metadata = {**gguf.metadata, "tokenizer.ggml.pre": pre}
    backend = build_gguf_tokenizer(metadata, smollm2_path).backend
    assert [p for p, _ in backend.pre_tokenizer.pre_tokenize_str("abc 12345\n\n")] == pieces
