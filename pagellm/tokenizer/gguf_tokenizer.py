"""Build a `tokenizers.Tokenizer` straight from GGUF metadata (vocabulary, merges, token types).

Going through `transformers` costs seconds; building the BPE model directly takes a fraction of
one. The result matches what transformers' GGUF conversion produces for byte-level BPE files.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (tokenizer.ggml.token_type).
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Split patterns for `tokenizer.ggml.pre` values whose vocabularies were trained with a non-GPT-2
# pre-tokenizer. Anything else gets the GPT-2 pattern built into `ByteLevel`, as in transformers.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_PATTERNS = {
    "llama3": _LLAMA3_PATTERN,
    "llama-v3": _LLAMA3_PATTERN,
    "llama-bpe": _LLAMA3_PATTERN,
    "smaug-bpe": _LLAMA3_PATTERN,
    "dbrx": _LLAMA3_PATTERN,
    "falcon3": _LLAMA3_PATTERN,
    "qwen2": _QWEN2_PATTERN,
    "deepseek-r1-qwen": _QWEN2_PATTERN,
}


@dataclass(slots=True)
class GGUFTokenizerSpec:
    """The backend plus what the file says about its special tokens and template."""

    backend: Tokenizer
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    chat_template: str | None


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level BPE tokens.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    given the code points 256, 257, ... in byte order, so every token is visible text.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_gguf_tokenizer(metadata: dict[str, Any], path: str) -> GGUFTokenizerSpec:
    """The tokenizer described by a GGUF file's `tokenizer.*` metadata."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{path!r}: GGUF tokenizer model {model!r} is not supported yet (only byte-level BPE, 'gpt2'); "
            "use the model's Hugging Face directory with tokenizer.json instead"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges: list[str] | None = metadata.get("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{path!r}: byte-level BPE GGUF file has no tokenizer.ggml.merges")

    alphabet = byte_to_unicode()
    alphabet_chars = set(alphabet.values())
    # A few converters store a token in raw UTF-8 rather than the byte alphabet; respell it.
    vocab = {
        (tok if set(tok) <= alphabet_chars else "".join(alphabet[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    bpe = models.BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ", 1)) for m in merges],
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = Tokenizer(bpe)
    pattern = SPLIT_PATTERNS.get(metadata.get("tokenizer.ggml.pre", ""))
    if pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()

    # CONTROL tokens become special; a "control" token spelled outside the byte alphabet is a
    # converter mislabel, and adding it would grow the vocabulary past the embedding size.
    special = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_CONTROL and set(tok) <= alphabet_chars
    ]
    # USER_DEFINED tokens (e.g. `<think>`) are matched whole in text but are not special.
    user_defined = [
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types)
        if kind == TOKEN_TYPE_USER_DEFINED and tok in vocab
    ]
    backend.add_special_tokens(special)
    backend.add_tokens(user_defined)

    def token(key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    # Byte-level BPE files add no BOS unless they say so (transformers' GPT-2 default).
    prefix = [(bos, metadata["tokenizer.ggml.bos_token_id"])] if bos and metadata.get("tokenizer.ggml.add_bos_token") else []
    suffix = [(eos, metadata["tokenizer.ggml.eos_token_id"])] if eos and metadata.get("tokenizer.ggml.add_eos_token") else []
    if prefix or suffix:
        single = [t for t, _ in prefix] + ["$A:0"] + [t for t, _ in suffix]
        pair = single + [f"{t}:1" for t, _ in prefix] + ["$B:1"] + [f"{t}:1" for t, _ in suffix]
        backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=prefix + suffix)

    return GGUFTokenizerSpec(
        backend=backend,
        bos_token=bos,
        eos_token=eos,
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=metadata.get("tokenizer.chat_template"),
    )
