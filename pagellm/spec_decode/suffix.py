"""Suffix decoding (SuffixDecoding, arXiv:2411.04975; vLLM's `"method": "suffix"`): propose the most
frequent continuation of the request's latest tokens, found in suffix tries over its own tokens
and over the outputs of recent requests, which pays off where requests repeat a task (agents,
extraction with a fixed template) and n-gram lookup within one prompt finds nothing."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagellm.config.speculative import SpeculativeConfig
from pagellm.spec_decode.proposer import HostProposer
from pagellm.spec_decode.suffix_tree import Cursor, SuffixTrie


@dataclass(slots=True)
class _RequestTrie:
    """A running request's own trie (prompt and output so far) and where its tokens end."""

    trie: SuffixTrie
    cursor: Cursor
    tokens: list[int]
    """The scheduler's list of the request's tokens (it only grows), read again by `forget`."""
    num_indexed: int
    num_prompt_tokens: int


class SuffixProposer(HostProposer):
    """Two kinds of trie (`SuffixTrie`, of depth suffix_decoding_max_tree_depth): one per running
    request over its prompt and output, extended by each call's new tokens only; and one global
    over the outputs of the last suffix_decoding_max_cached_requests requests to finish (first in,
    first out), to which `forget` moves a request's output. Each proposes from the longest suffix
    of the request's tokens it has seen continued; the proposal with the larger expected number of
    accepted tokens wins. A step costs depth trie steps per new token plus two binary searches of
    the match length, whatever the lengths of the requests."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.k = config.num_speculative_tokens
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.spec_factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.cache = SuffixTrie(self.depth)
        self._cached: deque[list[int]] = deque()
        """The outputs in `cache`, oldest first (to take them out again)."""
        self._requests: dict[str, _RequestTrie] = {}

    def propose(self, token_ids: list[int], max_tokens: int, req_id: str | None = None,
                num_prompt_tokens: int = 0) -> list[int]:
        """Up to min(num_speculative_tokens, max_tokens) tokens, and at most
        suffix_decoding_max_spec_factor per token of the match they continue. Without `req_id`
        the request's trie is built for this call alone."""
        own = self._own(token_ids, req_id, num_prompt_tokens)
        limit = min(self.k, max_tokens)
        if limit <= 0 or not token_ids:
            return []
        best: list[int] = []
        best_score = 0.0
        for trie in (own.trie, self.cache):
            node, length = trie.longest_match(token_ids)
            cap = min(limit, int(self.spec_factor * length + 1e-9))
            if length == 0 or cap <= 0:
                continue
            tokens, score = SuffixTrie.continuation(node, cap, self.min_prob)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def forget(self, req_id: str) -> None:
        """Drop the request's trie and add its output to the global one (finished or aborted alike:
        what it generated is as telling), evicting the oldest past the bound."""
        state = self._requests.pop(req_id, None)
        if state is None or self.max_cached == 0:
            return
        output = state.tokens[state.num_prompt_tokens:]
        if not output:
            return
        self.cache.insert(output)
        self._cached.append(output)
        if len(self._cached) > self.max_cached:
            self.cache.remove(self._cached.popleft())

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def _own(self, token_ids: list[int], req_id: str | None, num_prompt_tokens: int) -> _RequestTrie:
        state = None if req_id is None else self._requests.get(req_id)
        if state is None or len(token_ids) < state.num_indexed:  # (a reused id: start again)
            trie = SuffixTrie(self.depth)
            state = _RequestTrie(trie, trie.cursor(), token_ids, 0, num_prompt_tokens)
            if req_id is not None:
                self._requests[req_id] = state
        state.tokens = token_ids
        if len(token_ids) > state.num_indexed:
            state.cursor = state.trie.append(state.cursor, token_ids[state.num_indexed:])
            state.num_indexed = len(token_ids)
        return state
