"""Per-request block tables on top of the block pool: prefix lookup, allocation, freeing."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.core.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted in tokens, as vLLM's `prefix_cache_queries` / `prefix_cache_hits`."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Owns which blocks each request holds and which of them are registered in the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens, in whole blocks.

        The last token is never taken from the cache: it must run through the model to give
        the logits of the next token. Requests that want prompt logprobs take no hits: cached
        tokens produce no logits.
        """
        if not self.enable_caching or request.skips_prefix_cache:
            return [], 0
        request.update_block_hashes(self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (not the retries of a request left waiting)."""
        if self.enable_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> list[KVCacheBlock] | None:
        """Give the request room for `num_new_tokens` more tokens (after any prefix-cache hits).

        Returns the newly allocated blocks, or None (changing nothing) if the pool is too small.
        """
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_needed = -(-num_total // self.block_size) - len(req_blocks) - len(new_computed_blocks)
        # Hit blocks sitting in the free queue stop being allocatable once we take them.
        num_reclaimed = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            return None
        self.pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        req_blocks.extend(new_blocks)
        capacity = len(req_blocks) * self.block_size
        if self.enable_caching:
            self._cache_full_blocks(request, req_blocks, num_total)
            # Past this, a block fills and is registered in the prefix cache.
            capacity = min(capacity, (self._num_cached_blocks[request.request_id] + 1) * self.block_size - 1)
        request.kv_quiet_until = capacity
        return new_blocks

    def _cache_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Registered at allocation, before the KV is computed: a request that hits these blocks
        # in the same step reads them only after that step's KV write of each layer.
        request.update_block_hashes(self.block_size)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks.get(request.request_id, 0)
        for i in range(start, num_full):
            self.pool.cache_block(req_blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        request.kv_quiet_until = 0
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
