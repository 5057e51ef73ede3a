"""Prompt lookup: propose what followed an earlier occurrence of the request's latest n tokens."""
from __future__ import annotations

import numpy as np

from pagellm.config.speculative import SpeculativeConfig
from pagellm.spec_decode.proposer import HostProposer


class NgramProposer(HostProposer):
    """Vectorized: one comparison of the history with its last token finds the candidate ends, then
    at most prompt_lookup_max - 1 comparisons over those candidates measure each match's length
    (tens of microseconds per request for thousands of tokens, every decode step)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.k = config.num_speculative_tokens
        self.low, self.high = config.prompt_lookup_min, config.prompt_lookup_max
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}
        """Per request: its tokens as an array (with room to grow) and how many are filled in, so
        that a step converts only its new tokens (converting whole histories of a 64-request batch
        took 4 ms a step)."""

    def propose(self, token_ids: list[int], max_tokens: int, req_id: str | None = None,
                num_prompt_tokens: int = 0) -> list[int]:
        """Up to min(k, max_tokens) tokens that followed an earlier occurrence of the longest
        suffix of `token_ids` (between prompt_lookup_min and _max tokens long): the latest one
        with that many tokens after it, else the latest; [] if the suffix never occurred before.
        With `req_id`, the tokens of earlier calls are kept (a request's tokens only grow) until
        `forget(req_id)`."""
        limit = min(self.k, max_tokens)
        if limit <= 0 or len(token_ids) <= self.low:
            return []
        tokens = self._array(token_ids, req_id)
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

    def _array(self, token_ids: list[int], req_id: str | None) -> np.ndarray:
        if req_id is None:
            return np.asarray(token_ids, dtype=np.int64)
        n = len(token_ids)
        buffer, filled = self._arrays.get(req_id, (None, 0))
        if buffer is None or n > len(buffer):
            grown = np.empty(max(2 * n, 256), dtype=np.int64)
            if buffer is not None:
                grown[:filled] = buffer[:filled]
            buffer = grown
        if n > filled:
            buffer[filled:n] = token_ids[filled:n]
        self._arrays[req_id] = (buffer, n)
        return buffer[:n]

    def forget(self, req_id: str) -> None:
        self._arrays.pop(req_id, None)

    @property
    def num_requests_kept(self) -> int:
        return len(self._arrays)
