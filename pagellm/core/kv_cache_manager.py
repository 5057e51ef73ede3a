"""Per-request block tables on top of the block pool: prefix lookup, allocation, freeing; one table
per KV cache group (`pagellm.core.kv_cache_groups`), all drawing from one pool."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.core.hashing import BlockHash, group_block_hash
from pagellm.core.kv_cache_groups import window_blocks
from pagellm.core.request import Request

GroupBlocks = Sequence[Sequence["KVCacheBlock | None"]]
"""Per KV cache group, blocks by their index in the sequence; None where a sliding window no
longer reads one (given back, or never taken from a prefix-cache hit)."""
BlockIds = tuple[list[int], ...]
"""Per KV cache group, block ids."""
SKIPPED_BLOCK_ID = 0
"""What the workers' block tables hold for a block a sliding window no longer reads: any id would
do, since no kernel reads blocks before its queries' windows."""


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted in tokens, as vLLM's `prefix_cache_queries` / `prefix_cache_hits`."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Owns which blocks each request holds and which of them are registered in the prefix cache.

    Every group holds a request's blocks by the same indices (block i covers its tokens i x
    block_size ...), so all groups allocate alike; a sliding-window group gives back the blocks
    wholly before the window of the first token a step computes, when the request next allocates.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 sliding_windows: Sequence[int | None] = (None,)) -> None:
        """`sliding_windows`: each KV cache group's window (None: full attention)."""
        if not sliding_windows:
            raise ValueError("the KV cache needs at least one group")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.windows = tuple(sliding_windows)
        self._full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self._sliding_groups = [g for g, w in enumerate(self.windows) if w is not None]
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock | None], ...]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self._first_held: dict[str, list[int]] = {}
        """Per request and group, the index of its first block not given back (sliding groups)."""
        self._no_blocks: GroupBlocks = tuple(() for _ in self.windows)
        self._decode_blocks = [0 if w is None else window_blocks(w, block_size) for w in self.windows]
        """Per sliding group, the most blocks a decoding request holds (one token a step)."""
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest cached prefix of the request's tokens, in whole blocks, and each group's
        blocks of it: a full-attention group needs every block of the prefix, a sliding-window
        group only those the window of the first token after it reaches.

        The last token is never taken from the cache: it must run through the model to give
        the logits of the next token. Requests that want prompt logprobs take no hits: cached
        tokens produce no logits.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return self._no_blocks, 0
        request.update_block_hashes(self.block_size)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        num_hit = len(hashes)
        for g in self._full_groups:  # a prefix of a prefix hit hits too
            num_hit = self._prefix_hits(hashes, g, num_hit)
        while self._sliding_groups:  # a window's hit point need not stay one at a shorter prefix
            shortest = min(self._window_hits(hashes, g, num_hit) for g in self._sliding_groups)
            if shortest == num_hit:
                break
            num_hit = shortest
        hits = []
        for g in range(self.num_groups):
            first = self._first_needed(g, num_hit * self.block_size)
            hits.append([None] * first + [self.pool.get_cached_block(group_block_hash(h, g))
                                          for h in hashes[first:num_hit]])
        return hits, num_hit * self.block_size

    def _prefix_hits(self, hashes: list[BlockHash], group: int, limit: int) -> int:
        """How many blocks from the first are cached in `group`, at most `limit`."""
        for i in range(limit):
            if self.pool.get_cached_block(group_block_hash(hashes[i], group)) is None:
                return i
        return limit

    def _window_hits(self, hashes: list[BlockHash], group: int, limit: int) -> int:
        """The most blocks k <= limit such that sliding group `group` holds in the cache the blocks
        that the window of the token after them reaches (blocks `_first_needed` .. k - 1)."""
        k = limit
        i = k - 1
        while i >= self._first_needed(group, k * self.block_size):
            if self.pool.get_cached_block(group_block_hash(hashes[i], group)) is None:
                k = i  # no hit point past a missing block it needs
            i -= 1
        return k

    def _first_needed(self, group: int, position: int) -> int:
        """The first block the token at `position` reads in `group`."""
        window = self.windows[group]
        return 0 if window is None else max(position - window + 1, 0) // self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not the retries of a request left waiting)."""
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: GroupBlocks | None = None, cache: bool = True) -> BlockIds | None:
        """Give the request room for `num_new_tokens` more tokens (after any prefix-cache hits,
        `get_computed_blocks`'s), first giving back the blocks its windows no longer reach. With
        `cache` False its full blocks are not registered in the prefix cache yet (a remote load
        fills them later; its next allocation registers them).

        Returns the ids of the blocks newly allocated per group (not the hits), or None if the pool
        is too small (then nothing but the giving back has changed).
        """
        req_id = request.request_id
        groups = self.req_to_blocks.get(req_id)
        if groups is None:
            groups = self.req_to_blocks[req_id] = tuple([] for _ in self.windows)
            self._first_held[req_id] = [0] * self.num_groups
        hits = new_computed_blocks or self._no_blocks
        num_hit = len(hits[0])
        num_computed = request.num_computed_tokens + num_hit * self.block_size
        num_total = num_computed + num_new_tokens
        for g in self._sliding_groups:
            self._drop_outside_window(req_id, g, groups[g], num_computed)
        per_group = max(-(-num_total // self.block_size) - len(groups[0]) - num_hit, 0)
        # Hit blocks sitting in the free queue stop being allocatable once we take them.
        num_reclaimed = sum(1 for blocks in hits for b in blocks if b is not None and b.ref_cnt == 0)
        if per_group * self.num_groups > self.pool.num_free_blocks - num_reclaimed:
            return None
        new_ids = []
        for group, taken in zip(groups, hits):
            hit_blocks = [b for b in taken if b is not None]
            self.pool.touch(hit_blocks)
            group.extend(taken)
            new_blocks = self.pool.allocate(per_group)
            group.extend(new_blocks)
            new_ids.append([b.block_id for b in new_blocks])
        first_held = self._first_held[req_id]
        if num_hit:  # a window's hit starts at the blocks it reaches
            for g in self._sliding_groups:
                first_held[g] = self._first_needed(g, num_computed)
        capacity = len(groups[0]) * self.block_size
        if self.enable_caching and cache:
            self._cache_full_blocks(request, groups, num_total)
            # Past this, a block fills and is registered in the prefix cache.
            capacity = min(capacity, (self._num_cached_blocks[req_id] + 1) * self.block_size - 1)
        if any(len(groups[g]) - first_held[g] > self._decode_blocks[g] for g in self._sliding_groups):
            # More than decoding holds (a prompt chunk's worth): the next step gives the rest back.
            capacity = min(capacity, num_total)
        request.kv_quiet_until = capacity
        return tuple(new_ids)

    def _drop_outside_window(self, req_id: str, group: int, blocks: list[KVCacheBlock | None],
                             num_computed: int) -> None:
        """Give back the blocks of sliding group `group` wholly before the window of the token at
        `num_computed`, earliest first (the first evicted: a later hit needs the latest ones)."""
        first_held = self._first_held[req_id]
        end = min(self._first_needed(group, num_computed), len(blocks))
        if end <= first_held[group]:
            return
        dropped = [b for b in blocks[first_held[group]:end] if b is not None]
        blocks[first_held[group]:end] = [None] * (end - first_held[group])
        first_held[group] = end
        self.pool.free(dropped)

    def _cache_full_blocks(self, request: Request, groups: tuple[list[KVCacheBlock | None], ...],
                           num_tokens: int) -> None:
        # Registered at allocation, before the KV is computed: a request that hits these blocks
        # in the same step reads them only after that step's KV write of each layer.
        request.update_block_hashes(self.block_size)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for g, blocks in enumerate(groups):
            for i in range(start, num_full):
                if blocks[i] is not None:
                    self.pool.cache_block(blocks[i], group_block_hash(request.block_hashes[i], g))
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        request.kv_quiet_until = 0
        groups = self.req_to_blocks.pop(request.request_id, ())
        self._num_cached_blocks.pop(request.request_id, None)
        self._first_held.pop(request.request_id, None)
        if groups:  # tail first, across the groups: a request's tail is evicted before its prefix
            self.pool.free(b for i in reversed(range(len(groups[0]))) for blocks in groups
                           if (b := blocks[i]) is not None)

    def record_evictions(self) -> None:
        """Keep the cached blocks evicted from now on, for `take_evicted`."""
        self.pool.evicted = []

    def take_evicted(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of the cached blocks reallocated since the last call."""
        evicted, self.pool.evicted = self.pool.evicted, []
        return evicted

    def uncache_blocks(self, block_ids: set[int]) -> None:
        """Forget the prefix-cache entries of blocks whose content is wrong (a failed load)."""
        for block_id in block_ids:
            self.pool.uncache(self.pool.blocks[block_id])

    def uncache_uncomputed(self, request: Request) -> None:
        """Forget the prefix-cache entries of the request's blocks from its first not computed token
        on: registered when allocated, for tokens of a step that then withdrew them."""
        first = request.num_computed_tokens // self.block_size
        for blocks in self.req_to_blocks.get(request.request_id, ()):
            for block in blocks[first:]:
                if block is not None:
                    self.pool.uncache(block)

    def holds_any(self, request_id: str, block_ids: set[int]) -> bool:
        """Whether the request holds one of `block_ids` in some group."""
        return any(b is not None and b.block_id in block_ids
                   for blocks in self.req_to_blocks.get(request_id, ()) for b in blocks)

    def get_block_ids(self, request_id: str) -> BlockIds:
        """Per group, the request's block ids (`SKIPPED_BLOCK_ID` for blocks a window gave back)."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return self.empty_block_ids()
        return tuple([SKIPPED_BLOCK_ID if b is None else b.block_id for b in blocks] for blocks in groups)

    def num_blocks_held(self, request_id: str) -> list[int]:
        """Per group, how many blocks the request holds now."""
        groups = self.req_to_blocks.get(request_id, ())
        return [sum(b is not None for b in blocks) for blocks in groups] or [0] * self.num_groups

    def empty_block_ids(self) -> BlockIds:
        """No new block in any group."""
        return tuple([] for _ in self.windows)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
