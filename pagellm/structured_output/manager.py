"""The engine core's grammars: compiled off the step loop, one matcher per request, the step's bitmask.

A request with a grammar waits (without holding up others) until its compile finishes; past the
compile time limit it is rejected and its compile thread written off (`compile_pool`), and a
request for the same spec is rejected at once while that compile still runs. The matcher advances
with each token the scheduler appends; the bitmask the scheduler sends with a step allows, for
each grammar row, exactly the tokens that keep the output a prefix of the language (and the stop
tokens once it is complete).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from pagellm.reasoning import get_reasoning_tags
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.compile_pool import CompilePool
from pagellm.structured_output.errors import GrammarError
from pagellm.structured_output.source import GrammarSource
from pagellm.tokenizer import load_tokenizer

if TYPE_CHECKING:
    import xgrammar

    from pagellm.loader import ModelSource
    from pagellm.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_COMPILE_THREADS = 2
_MAX_WRITTEN_OFF = 1
"""Compiles past their time limit whose threads are replaced at once (see compile_pool)."""
_CACHE_LIMIT_BYTES = 512 << 20
"""xgrammar's compiled-grammar cache (LRU): distinct schemas must not grow the core's memory forever."""


def build_tokenizer_info(tokenizer: "Tokenizer", vocab_size: int,
                         stop_token_ids: list[int]) -> "xgrammar.TokenizerInfo":
    """xgrammar's view of the vocabulary: each id's token string, how strings encode bytes (byte-level
    BPE, byte fallback or raw), the logits' width and the stop tokens."""
    import xgrammar as xgr

    encoded = [""] * vocab_size
    for token, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    # xgrammar's own detection from a Hugging Face fast tokenizer's JSON (what from_huggingface uses).
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    return xgr.TokenizerInfo(encoded, vocab_type=metadata["vocab_type"], vocab_size=vocab_size,
                             stop_token_ids=sorted(stop_token_ids), add_prefix_space=metadata["add_prefix_space"])


class RequestGrammar:
    """One request's grammar: compiling, then a matcher that follows its output tokens."""

    __slots__ = ("_future", "_started", "_kind", "_timeout_s", "_on_timeout", "_timing", "_matcher",
                 "waiting_for_token", "_may_open")

    def __init__(self, future: "concurrent.futures.Future", kind: str, timeout_s: float,
                 on_timeout: Callable[[], None] = lambda: None, timing: Callable[[], bool] = lambda: True) -> None:
        self._future = future
        self._kind = kind
        self._timeout_s = timeout_s
        self._on_timeout = on_timeout
        """Called once the compile has run past `timeout_s`."""
        self._timing = timing
        """Whether a running compile's time counts: not while the vocabulary table is built (once, by
        the first grammar: seconds, the import of xgrammar included)."""
        self._started: float | None = None
        """When the compile was first seen running: its time limit counts from there, not from the
        time it queued behind others."""
        self._matcher: "xgrammar.GrammarMatcher | None" = None
        self.waiting_for_token: int | None = None
        """A reasoning model's end-of-reasoning token: the grammar applies once it was generated."""
        self._may_open: tuple[int, int] | None = None
        """(start, end) of reasoning the first output token may open (Qwen3 style): that token is
        allowed besides the grammar's, and if sampled, the grammar waits for the end."""

    def ready(self) -> bool:
        """Whether the matcher exists; raises GrammarError if the compile failed or ran out of time."""
        if self._matcher is not None:
            return True
        if not self._future.done():
            if self._future.running() and self._timing():
                now = time.monotonic()
                self._started = self._started or now
                if now - self._started > self._timeout_s:
                    self._on_timeout()
                    raise GrammarError(self._kind, f"took longer than {self._timeout_s:g} s to compile "
                                                   "(--structured-outputs-compile-timeout); simplify it")
            return False
        try:
            self._matcher, (self.waiting_for_token, self._may_open) = self._future.result()
        except GrammarError:
            raise
        except BaseException as e:  # cancelled at shutdown
            raise GrammarError(self._kind, f"was not compiled: {type(e).__name__}") from None
        return True

    def cancel(self) -> None:
        """The request is gone: a compile still queued never runs (one running cannot be stopped)."""
        self._future.cancel()

    @property
    def active(self) -> bool:
        """Whether the next token is constrained."""
        return self._matcher is not None and self.waiting_for_token is None

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)
        if self._may_open is not None:
            start = self._may_open[0]
            word = bitmask[row, start // 32].view(np.uint32) | np.uint32(1 << (start % 32))
            bitmask[row, start // 32] = word.view(np.int32)

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; True when the output is complete. GrammarError when the
        token breaks the grammar (the mask makes that impossible unless nothing was left to sample)."""
        if self._may_open is not None:
            start, end = self._may_open
            self._may_open = None
            if token_id == start:
                self.waiting_for_token = end
                return False
        if self.waiting_for_token is not None:
            if token_id == self.waiting_for_token:
                self.waiting_for_token = None
            return False
        if not self._matcher.accept_token(token_id):
            # Only when every token was masked (allowed_token_ids or bad_words banned all the grammar
            # allows): the output cannot go on in the language.
            raise GrammarError(self._kind, f"token {token_id} is outside the grammar: the request's other "
                                           "settings (allowed_token_ids, bad_words) banned every "
                                           "token the grammar allowed")
        return self._matcher.is_terminated()


class GrammarManager:
    """Compiles the grammars of the engine core's requests in a thread pool (xgrammar releases the
    GIL), cached by spec, and fills each step's bitmask."""

    def __init__(self, source: "ModelSource", vocab_size: int, timeout_s: float, reasoning_parser: str | None) -> None:
        self._source = source
        self._vocab_size = vocab_size
        self._timeout_s = timeout_s
        self._reasoning = get_reasoning_tags(reasoning_parser) if reasoning_parser else None
        self._pool = CompilePool(_COMPILE_THREADS, _MAX_WRITTEN_OFF, "grammar")
        self._lock = threading.Lock()
        """Guards `_pending` and `_overdue` (the step loop and the pool's callbacks)."""
        self._init_lock = threading.Lock()
        self._compiler: "xgrammar.GrammarCompiler | None" = None
        self._reasoning_ids: tuple[int | None, int | None] = (None, None)
        self._pending: set[concurrent.futures.Future] = set()
        self._overdue: set[str] = set()
        """Keys of the specs whose compile ran past the time limit and still runs."""

    def start(self, params: StructuredOutputsParams, prompt_token_ids: list[int],
              eos_token_ids: frozenset[int]) -> RequestGrammar:
        """Begin compiling a request's grammar (the frontend already checked that it parses)."""
        source = GrammarSource.of(params)
        with self._lock:
            overdue = source.key in self._overdue
        if overdue:  # a second thread on it would run as long
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.set_exception(GrammarError(source.kind, f"took longer than {self._timeout_s:g} s to compile "
                                                           "(--structured-outputs-compile-timeout) for an earlier "
                                                           "request, and is compiling still; simplify it"))
            return RequestGrammar(future, source.kind, self._timeout_s)
        future = self._pool.submit(self._build, source, prompt_token_ids, eos_token_ids)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._discard)
        return RequestGrammar(future, source.kind, self._timeout_s, lambda: self._overran(future, source),
                              lambda: self._compiler is not None)

    def wait(self, timeout_s: float) -> None:
        """Block until some compile finishes or `timeout_s` passes: the core has nothing else to do."""
        with self._lock:
            pending = list(self._pending)
        if pending:
            concurrent.futures.wait(pending, timeout_s, return_when=concurrent.futures.FIRST_COMPLETED)

    def bitmask(self, grammars: list[RequestGrammar]) -> np.ndarray:
        """int32 [len(grammars), ceil(vocab / 32)]: bit j of word w allows token 32 * w + j."""
        bits = np.full((len(grammars), -(-self._vocab_size // 32)), -1, dtype=np.int32)
        for row, grammar in enumerate(grammars):
            grammar.fill(bits, row)
        return bits

    def shutdown(self) -> None:
        self._pool.shutdown()

    def _discard(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _overran(self, future: concurrent.futures.Future, source: GrammarSource) -> None:
        """A compile ran past the time limit: its request is refused; it cannot be stopped."""
        with self._lock:
            if source.key in self._overdue or future.done():
                return
            self._overdue.add(source.key)
        future.add_done_callback(lambda _: self._forget_overdue(source.key))
        if self._pool.write_off(future):
            logger.warning("a %s grammar took longer than %g s to compile; its request is refused, and the compile "
                           "goes on in a thread of its own until it ends (xgrammar cannot stop it)",
                           source.kind, self._timeout_s)
        else:
            logger.warning("a %s grammar took longer than %g s to compile; its request is refused, and the compile "
                           "keeps its thread until it ends (another overdue compile has a thread of its own "
                           "already): grammars compile on one thread fewer meanwhile", source.kind, self._timeout_s)

    def _forget_overdue(self, key: str) -> None:
        """The overdue compile ended: the spec may be compiled again (xgrammar cached it if it succeeded)."""
        with self._lock:
            self._overdue.discard(key)

    def _build(self, source: GrammarSource, prompt_token_ids: list[int],
               eos_token_ids: frozenset[int]) -> tuple["xgrammar.GrammarMatcher", tuple]:
        """(matcher, its reasoning state: see _reasoning_state). Runs in the pool."""
        import xgrammar as xgr

        try:
            compiled = self._get_compiler(eos_token_ids).compile_grammar(source.parse())
            return xgr.GrammarMatcher(compiled), self._reasoning_state(prompt_token_ids)
        except GrammarError:
            raise
        except Exception as e:  # a failure here (tokenizer table, compile) fails this request, never the engine
            logger.exception("compiling a %s grammar failed", source.kind)
            raise GrammarError(source.kind, f"could not be compiled: {type(e).__name__}: {e}") from None

    def _reasoning_state(self, prompt_token_ids: list[int]) -> tuple[int | None, tuple[int, int] | None]:
        """(the end-of-reasoning token to wait for, the (start, end) the first token may open) at the
        start of the output. A prompt that already closed the reasoning (a template that turns
        thinking off writes an empty block) starts constrained; one the template left open
        (DeepSeek-R1) waits for the end; otherwise the output may open it (Qwen3)."""
        start_id, end_id = self._reasoning_ids
        if end_id is None:
            return None, None
        for token_id in reversed(prompt_token_ids):
            if token_id == end_id:
                return None, None
            if token_id == start_id:
                return end_id, None
        if self._reasoning.opens_in_prompt:
            return end_id, None
        return None, ((start_id, end_id) if start_id is not None else None)

    def _get_compiler(self, eos_token_ids: frozenset[int]) -> "xgrammar.GrammarCompiler":
        # Its own lock: building the vocabulary table takes seconds, and the step loop takes `_lock`.
        with self._init_lock:
            if self._compiler is None:
                import xgrammar as xgr

                tokenizer = load_tokenizer(self._source)
                info = build_tokenizer_info(tokenizer, self._vocab_size, list(eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS,
                                                     cache_limit_bytes=_CACHE_LIMIT_BYTES)
                if self._reasoning is not None:
                    ids = tuple(tokenizer.backend.token_to_id(t) for t in (self._reasoning.start, self._reasoning.end))
                    if ids[1] is None:
                        logger.warning("the reasoning parser's end tag %r is not a token of this model: structured "
                                       "output applies from the first token", self._reasoning.end)
                    self._reasoning_ids = ids
            return self._compiler
