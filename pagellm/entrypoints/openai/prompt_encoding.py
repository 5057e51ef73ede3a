"""Prompt texts to token ids without holding up the server: a text that cannot fit the model's
context is refused by its length before it is tokenized, and long texts are tokenized on a small
pool of threads of their own, off the event loop that answers every request (and /health).

Tokenizing costs about 0.5 s and 90 MB of transient memory a MB of text on a CPU core: hence a
bound before tokenizing, few threads, and the memory they freed handed back to the system after
each long text (glibc's malloc would keep it in the thread's arena: 400 MB after two 2 MB prompts).
"""
from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from pagellm.entrypoints.openai.errors import APIError
from pagellm.tokenizer import Tokenizer

OFF_LOOP_CHARS = 8192
"""Texts of more characters than this (in all) are tokenized on the pool; shorter ones, a millisecond
or less of work, cost less on the event loop than the hop to a thread."""
TOKENIZE_THREADS = 2
"""Long texts tokenized at once; more would wait their turn. Bounds the CPU they take from the
engine and the memory their threads keep."""

_pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="pagellm-tokenize")


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, which returns the free memory of every arena to the system; None elsewhere."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, TypeError, AttributeError):  # not glibc (macOS, musl, Windows)
        return None


_trim = _malloc_trim()


def _encode_and_trim(tokenizer: Tokenizer, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
    ids = tokenizer.encode_batch(texts, add_special_tokens)
    if _trim is not None:
        _trim(0)  # a few ms; the tokenizer's intermediates are freed by now
    return ids


async def encode_texts(tokenizer: Tokenizer, texts: Sequence[str], add_special_tokens: bool, max_model_len: int,
                       param: str, truncating: bool = False) -> list[list[int]]:
    """The token ids of each of `texts` (the request field `param`). Unless the request truncates its
    prompts (`truncating`: they are cut to their last tokens after tokenizing), a text that cannot
    fit is refused (400 naming `param`) before any is tokenized: one of more characters than
    max_model_len tokens of the vocabulary's longest entry could cover."""
    bound = max_model_len * tokenizer.max_token_chars
    for text in () if truncating else texts:
        if len(text) > bound:
            raise APIError(f"{param} is {len(text)} characters long, more than this model's context of "
                           f"{max_model_len} tokens can hold (a token covers at most {tokenizer.max_token_chars} "
                           "characters); shorten it", param=param)
    if sum(map(len, texts)) <= OFF_LOOP_CHARS:
        return tokenizer.encode_batch(texts, add_special_tokens)
    return await asyncio.get_running_loop().run_in_executor(_pool, _encode_and_trim, tokenizer, texts,
                                                            add_special_tokens)
