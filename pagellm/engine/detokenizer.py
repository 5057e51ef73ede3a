"""Incremental detokenization of one request's output, with stop strings.

Each new token is decoded on its own against a short context (`tokenizers`' DecodeStream), so the
cost per step does not grow with the output. Stop strings are searched only where a match could
end in the newly decoded text; while streaming, the tail that could still be the start of a stop
string is held back from the caller until it is known not to be one.
"""
from __future__ import annotations

from collections.abc import Sequence

from pagellm.sampling_params import SamplingParams
from pagellm.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Text of one output sequence, grown token by token; reports the stop string that ended it."""

    __slots__ = ("_tokenizer", "_stream", "_skip_special", "_spaced_specials", "_stop", "_include_stop",
                 "_hold_back", "_token_ids", "_pending_bytes", "_after_special", "text", "_num_sent_chars")

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stream = tokenizer.decode_stream(params.skip_special_tokens)
        # Only kept special tokens can be spaced out; with skip_special_tokens there are none.
        self._spaced_specials = params.spaces_between_special_tokens and not params.skip_special_tokens
        self._stop = list(params.stop or ())
        self._include_stop = params.include_stop_str_in_output
        # A stop string kept in the output needs no hold-back: its prefix is output either way.
        self._hold_back = max((len(s) for s in self._stop), default=1) - 1 if not self._include_stop else 0
        self._token_ids: list[int] = []
        self._pending_bytes = False
        """A regular token decoded to nothing yet: its bytes are part of an unfinished character."""
        self._after_special = False
        self.text = ""
        self._num_sent_chars = 0

    def update(self, new_token_ids: Sequence[int]) -> tuple[int, str | None]:
        """Decode new tokens in order, stopping at the first one that completes a stop string.

        Returns (how many of `new_token_ids` were taken, the matched stop string or None). Tokens
        after a stop string are dropped: the request ended there.
        """
        for i, token_id in enumerate(new_token_ids):
            self._token_ids.append(token_id)
            num_chars_before = len(self.text)
            self._append(token_id, self._stream.step(self._tokenizer.backend, token_id))
            stop = self._find_stop(num_chars_before)
            if stop is not None:
                return i + 1, stop
        return len(new_token_ids), None

    def _append(self, token_id: int, piece: str | None) -> None:
        is_special = token_id in self._tokenizer.all_special_ids
        if not piece:
            self._pending_bytes = not is_special
            return
        self._pending_bytes = False
        if self._spaced_specials and self.text and (is_special or self._after_special):
            piece = " " + piece
        self._after_special = is_special
        self.text += piece

    def _find_stop(self, num_chars_before: int) -> str | None:
        """The stop string whose match ends first in the text added since `num_chars_before`;
        the text is cut there (after it with include_stop_str_in_output)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = self.text.find(stop, max(0, num_chars_before - len(stop) + 1))
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                best = candidate if best is None else min(best, candidate)
        if best is None:
            return None
        end, start, stop = best
        self.text = self.text[:end if self._include_stop else start]
        return stop

    def finish(self) -> None:
        """Generation ended without a stop string: render bytes of a character left unfinished
        (as a whole-sequence decode would, with U+FFFD) so the text matches `decode(token_ids)`."""
        if not self._pending_bytes:
            return
        self._pending_bytes = False
        full = self._tokenizer.decode(self._token_ids, skip_special_tokens=self._skip_special)
        if full.startswith(self.text):  # spaced special tokens make the two differ: keep ours
            self.text = full

    def next_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: all of it (or only what is new if `delta`), minus the tail that
        could still become a stop string unless the request has finished."""
        visible = len(self.text) if finished else max(len(self.text) - self._hold_back, self._num_sent_chars)
        start = self._num_sent_chars if delta else 0
        self._num_sent_chars = visible
        return self.text[start:visible]
