"""Prompt lookup: propose what followed an earlier occurrence of the request's latest n tokens."""
from __future__ import annotations

import numpy as np

from pagellm.spec_decode.config import SpeculativeConfig


class NgramProposer:
    """Vectorized: one comparison of the history with its last token finds the candidate ends, then
    at most prompt_lookup_max - 1 comparisons over those candidates measure each match's length
    (tens of microseconds per request for thousands of tokens, every decode step)."""

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
        n = len(tokens)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where an earlier occurrence would end
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)  # of each candidate's match, up to `high`
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.high, n)):
            before = ends - back
            alive &= before >= 0
            alive[alive] = tokens[before[alive]] == tokens[n - 1 - back]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.low:
            return []
        hits = ends[length == best]
        # In a loop (an output repeating itself) the latest occurrence is just behind the suffix,
        # with a token or two after it; one a full proposal further back is as good.
        full = hits[hits + 1 + limit <= n]
        start = int(full[-1] if full.size else hits[-1]) + 1
        return tokens[start:start + limit].tolist()
