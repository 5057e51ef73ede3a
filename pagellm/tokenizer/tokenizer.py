"""The engine's tokenizer: a `tokenizers.Tokenizer` plus special tokens and the chat template.

Loaded from a GGUF file's metadata or a Hugging Face directory's `tokenizer.json`; never through
`transformers`, whose import and conversion cost seconds of start-up time.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from pagellm.loader.gguf_file import GGUFFile
from pagellm.loader.source import ModelSource, read_json
from pagellm.tokenizer.chat_template import render_chat_template
from pagellm.tokenizer.gguf_tokenizer import build_gguf_tokenizer


class Tokenizer:
    """Encode, decode (whole or streamed) and render chat prompts for one model."""

    __slots__ = ("backend", "vocab_size", "bos_token", "eos_token", "unk_token", "pad_token",
                 "bos_token_id", "eos_token_id", "all_special_ids", "chat_template", "max_token_chars")

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token, self.unk_token, self.pad_token = bos_token, eos_token, unk_token, pad_token
        self.bos_token_id = self._token_id(bos_token)
        self.eos_token_id = self._token_id(eos_token)
        named = {self._token_id(t) for t in (bos_token, eos_token, unk_token, pad_token)} - {None}
        added = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        self.all_special_ids: set[int] = named | added
        self.chat_template = chat_template
        # A vocabulary entry has a character per byte it stands for (byte-level BPE: a character of
        # the text is at least a byte) or per character (SentencePiece, whose byte-fallback entries
        # stand for less), so no token covers more characters of a text than the longest entry has,
        # and a text of more than max_token_chars * N characters is more than N tokens. (Not so for
        # a normalizer that drops text, as BERT's drops whitespace; no model served here has one.)
        self.max_token_chars: int = max(map(len, backend.get_vocab(with_added_tokens=True)))
        """The most characters of a text one token covers: bounds a text's token count before tokenizing it."""

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, as `encode` gives them. Unlike `encode`, it lets go of the GIL while
        it works, so that run on a worker thread it does not hold up the caller's other threads."""
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        """A fresh incremental detokenizer; feed it with `stream.step(tokenizer.backend, token_id)`.

        It holds back bytes of an incomplete UTF-8 character, so `step` returns None until the
        character is complete.
        """
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `conversation`, rendered like `transformers`' `apply_chat_template`."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                "this model's tokenizer has no chat template; pass `chat_template` (a Jinja string) "
                "or send a plain-text prompt instead of chat messages"
            )
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        special_tokens = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        return render_chat_template(template, conversation, add_generation_prompt, special_tokens, **kwargs)


def load_tokenizer(source: ModelSource) -> Tokenizer | None:
    """The source's tokenizer (its `--tokenizer` if given); None when there is none (a dummy preset, or a
    dummy config-only folder)."""
    if source.tokenizer is not None:
        return _checked_tokenizer(source)
    path = source.path
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf_tokenizer(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return _load_hf_tokenizer(path, source.generation_config)
    if source.load_format == "dummy":
        return None
    raise ValueError(
        f"model {path!r} has no tokenizer.json; pagellm reads only the fast-tokenizer format. Create it once "
        "with transformers: AutoTokenizer.from_pretrained(path).save_pretrained(path)"
    )


def load_tokenizer_at(path: str) -> Tokenizer:
    """The tokenizer of a `.gguf` file or of a directory with `tokenizer.json`, without the model's
    architecture (the router counts tokens with it and never loads a model)."""
    if os.path.isfile(path) and path.endswith(".gguf"):
        return _load_gguf_tokenizer(path)
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        generation_config = read_json(os.path.join(path, "generation_config.json"), missing_ok=True)
        return _load_hf_tokenizer(path, generation_config)
    raise ValueError(f"tokenizer {path!r} is neither a .gguf file nor a directory with tokenizer.json")


def _checked_tokenizer(source: ModelSource) -> Tokenizer:
    """`--tokenizer`, refused (naming the flag) when it is missing or has ids the model cannot embed."""
    try:
        tokenizer = load_tokenizer_at(source.tokenizer)
    except (ValueError, OSError) as e:
        raise ValueError(f"tokenizer (--tokenizer): {e}") from None
    if tokenizer.vocab_size > source.arch.vocab_size:
        raise ValueError(f"tokenizer (--tokenizer) {source.tokenizer!r} has {tokenizer.vocab_size} tokens, more than "
                         f"the model's vocab_size {source.arch.vocab_size}")
    return tokenizer


def _load_gguf_tokenizer(path: str) -> Tokenizer:
    with GGUFFile(path) as gguf:
        spec = build_gguf_tokenizer(gguf.metadata, path)
    return Tokenizer(spec.backend, bos_token=spec.bos_token, eos_token=spec.eos_token, unk_token=spec.unk_token,
                     pad_token=spec.pad_token, chat_template=spec.chat_template)


def _load_hf_tokenizer(directory: str, generation_config: dict[str, Any]) -> Tokenizer:
    backend = BackendTokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    config = read_json(os.path.join(directory, "tokenizer_config.json"), missing_ok=True)
    tokens = {name: _token_content(config.get(name)) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    # Some configs name no BOS/EOS; generation_config.json then has the ids.
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
        token_id = generation_config.get(key)
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if tokens[name] is None and token_id is not None:
            tokens[name] = backend.id_to_token(token_id)
    return Tokenizer(backend, chat_template=_read_chat_template(directory, config), **tokens)


def _read_chat_template(directory: str, config: dict[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template to its own file, which then takes precedence.
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read()
    # A multimodal processor's template, as older transformers saved it (llava-hf/llava-1.5-7b-hf):
    # the one that places images, before the tokenizer's.
    processor_template = read_json(os.path.join(directory, "chat_template.json"), missing_ok=True).get("chat_template")
    if isinstance(processor_template, str):
        return processor_template
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value

