"""Suffix decoding (SuffixDecoding, arXiv:2411.04975; vLLM's `"method": "suffix"`): propose the most
frequent continuation of the request's latest tokens, found in suffix tries over its own tokens
and over the outputs of recent requests, which pays off where requests repeat a task (agents,
extraction with a fixed template) and n-gram lookup within one prompt finds nothing."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagellm.config.speculative import SpeculativeConfig
from pagellm.spec_decode.proposer import HostProposer
from pagellm.spec_decode.suffix_tree import Cursor, SuffixTrie, TrieNode

INDEX_BUDGET = 256
"""The most tokens a call adds to a request's own trie: a long prompt is indexed over its first
steps (its own trie proposes once it has caught up), not in one step (2,000 tokens took 120 ms on
a busy 2-core host, 60 us a token)."""


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
    first out), to which `forget` moves a request's output. Each matches the suffixes of the
    request's tokens it has seen continued, the longest first (`_best_match`); the proposal with
    the larger expected number of accepted tokens wins. A step costs depth trie steps per new
    token plus at most depth^2 for the matches, whatever the lengths of the requests."""

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
        the request's trie is built for this call alone, whole."""
        own = self._own(token_ids, req_id, num_prompt_tokens)
        limit = min(self.k, max_tokens)
        if limit <= 0 or not token_ids:
            return []
        context = token_ids[max(0, len(token_ids) - self.depth):]
        best, score = [], 0.0
        if own.num_indexed == len(token_ids):  # caught up: its cursor is at the request's end
            # The cursor holds the node of each suffix of the request's tokens; a suffix seen
            # continued has shorter ones that were too, down to length 1.
            longest = next((n for n in range(len(own.cursor) - 1, 0, -1) if own.cursor[n].child is not None), 0)
            best, score = self._best_match(own.cursor.__getitem__, longest, limit)
        _, longest = self.cache.longest_match(context)
        if longest:
            tokens, cache_score = self._best_match(lambda n: self.cache.find(context[len(context) - n:]),
                                                   longest, limit)
            if cache_score > score:
                best = tokens
        return best

    def _best_match(self, node_of: Callable[[int], TrieNode], longest: int, limit: int) -> tuple[list[int], float]:
        """The continuation with the most tokens expected to be accepted among the matches of
        `longest` tokens down to 1 (`node_of(n)`: the node of the last n), each allowed
        int(max_spec_factor * n) tokens; the longest on ties. The longest match alone would leave a
        loop little to propose: its one occurrence before ends where the request's tokens do."""
        best: list[int] = []
        best_score = 0.0
        for n in range(longest, 0, -1):
            cap = min(limit, int(self.spec_factor * n + 1e-9))
            if cap <= best_score:  # each token adds at most 1: no shorter match can do better
                break
            tokens, score = SuffixTrie.continuation(node_of(n), cap, self.min_prob)
            if score > best_score:
                best, best_score = tokens, score
        return best, best_score

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
        """How many finished requests' outputs the global trie holds."""
        return len(self._cached)

    @property
    def num_requests_kept(self) -> int:
        return len(self._requests)

    def _own(self, token_ids: list[int], req_id: str | None, num_prompt_tokens: int) -> _RequestTrie:
        state = None if req_id is None else self._requests.get(req_id)
        if state is None or len(token_ids) < state.num_indexed:  # (a reused id: start again)
            trie = SuffixTrie(self.depth)
            state = _RequestTrie(trie, trie.cursor(), token_ids, 0, num_prompt_tokens)
            if req_id is not None:
                self._requests[req_id] = state
        state.tokens = token_ids
        if len(token_ids) > state.num_indexed:
            end = len(token_ids) if req_id is None else min(len(token_ids), state.num_indexed + INDEX_BUDGET)
            state.cursor = state.trie.append(state.cursor, token_ids[state.num_indexed:end])
            state.num_indexed = end
        return state
