"""Which data-parallel replica serves a request: by prefix, then by load.

A replica that served a prompt's prefix probably still holds its KV blocks (prefix caching), so
a request goes to the replica that served the longest block-aligned prefix of its prompt seen
lately, unless that replica has far more work queued than the idlest one; otherwise, and when
no prefix was seen, to the replica with the least work (prompt plus max_tokens of the requests
it has not finished).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

PREFIX_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
"""Prefix lengths, in blocks, remembered per request: a request can follow another that shares
any of them."""
MAX_REMEMBERED_PREFIXES = 1 << 16
"""The least recently used prefixes are forgotten beyond this many (the replicas' caches evict too)."""
OVERLOAD_FACTOR = 2
"""A prefix match is ignored when its replica has more than this many times the idlest replica's
work (plus this request's own): waiting there would cost more than recomputing the prefix."""


class DataParallelRouter:
    def __init__(self, num_replicas: int, block_size: int) -> None:
        self.num_replicas = num_replicas
        self.block_size = block_size
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        """Hash of a prompt prefix -> the replica that last served it."""
        self.num_routed = 0
        self.num_prefix_routed = 0
        """Requests sent where a prefix of theirs was served before."""

    def route(self, prompt_token_ids: Sequence[int], cost: int, loads: Sequence[int],
              alive: Sequence[bool]) -> int:
        """The replica for a request of `cost` tokens (prompt plus what it may generate), given
        each replica's outstanding tokens and whether it is alive (at least one must be)."""
        keys = self._prefix_keys(prompt_token_ids)
        idlest = min((i for i in range(self.num_replicas) if alive[i]), key=loads.__getitem__)
        choice = idlest
        for key in reversed(keys):  # longest prefix first
            replica = self._prefixes.get(key)
            if replica is not None and alive[replica]:
                if loads[replica] <= OVERLOAD_FACTOR * (loads[idlest] + cost):
                    choice = replica
                    self.num_prefix_routed += 1
                break
        for key in keys:
            self._prefixes[key] = choice
            self._prefixes.move_to_end(key)
        while len(self._prefixes) > MAX_REMEMBERED_PREFIXES:
            self._prefixes.popitem(last=False)
        self.num_routed += 1
        return choice

    def _prefix_keys(self, prompt_token_ids: Sequence[int]) -> list[int]:
        # The last prompt token is always recomputed, so only prefixes before it can be cached.
        cacheable = len(prompt_token_ids) - 1
        return [hash(tuple(prompt_token_ids[:n * self.block_size])) for n in PREFIX_BLOCKS
                if n * self.block_size <= cacheable]
