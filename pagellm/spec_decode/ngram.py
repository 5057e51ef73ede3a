"""Prompt lookup: propose what followed the last occurrence of the request's latest n tokens."""
from __future__ import annotations

import numpy as np

from pagellm.spec_decode.config import SpeculativeConfig


class NgramProposer:
    """Vectorized over the history: one comparison of every window with the suffix per n."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to min(k, max_tokens) tokens that followed an earlier occurrence of the longest
        suffix of `token_ids` (between prompt_lookup_min and _max tokens long): the latest one
        with that many tokens after it, else the latest; [] if the suffix never occurred before."""
        limit = min(self.k, max_tokens)
        if limit <= 0 or len(token_ids) <= self.low:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.high, len(tokens) - 1), self.low - 1, -1):
            # Windows starting at 0 .. len - n - 1: each ends before the suffix's last token.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                # In a loop (an output repeating itself) the latest occurrence is just behind the
                # suffix, with a token or two after it; one a full proposal further back is as good.
                full = hits[hits + n + limit <= len(tokens)]
                start = int(full[-1] if full.size else hits[-1]) + n
                return tokens[start:start + limit].tolist()
        return []
