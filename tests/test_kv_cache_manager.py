"""KVCacheManager: block tables, prefix-cache lookups, allocation and freeing (pure Python)."""
from __future__ import annotations

import math

import pytest

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.request import EngineCoreRequest, Request
from pagellm.sampling_params import SamplingParams


def make_req(rid: str, tokens, salt: str | None = None) -> Request:
    return Request.from_record(EngineCoreRequest(request_id=rid, prompt_token_ids=list(tokens),
                                                 sampling_params=SamplingParams(), eos_token_ids=frozenset(),
                                                 max_tokens=16, cache_salt=salt))


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None):
    """Look up the prefix cache and allocate like the scheduler admits a waiting request.
    Returns (num_hit_tokens, new_blocks); on success the scheduled tokens count as computed."""
    hits, num_hit = kv.get_computed_blocks(req)
    if num_new is None:
        num_new = req.num_tokens - num_hit
    new = kv.allocate_slots(req, num_new, hits)
    if new is not None:
        kv.record_prefix_lookup(req.num_tokens, num_hit)
        req.num_computed_tokens = num_hit + num_new
    return num_hit, new


def extend(kv: KVCacheManager, req: Request, num_new: int):
    new = kv.allocate_slots(req, num_new)
    if new is not None:
        req.num_computed_tokens += num_new
    return new


def snapshot(kv: KVCacheManager):
    pool = kv.pool
    return (
        pool.num_free_blocks,
        [b.block_id for b in pool.free_queue],
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        dict(pool.cached),
        {rid: [[b.block_id for b in blocks] for blocks in groups] for rid, groups in kv.req_to_blocks.items()
         if any(groups)},
    )


def assert_no_leak(kv: KVCacheManager) -> None:
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.usage == 0.0
    assert not any(kv.req_to_blocks.values())


# -- allocation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 16, 17])
def test_block_count_follows_computed_tokens_across_chunks(block_size, chunk):
    kv = KVCacheManager(num_blocks=64, block_size=block_size, enable_caching=True)
    req = make_req("r", range(1000, 1000 + 3 * block_size + 2))
    total_new = 0
    first = True
    while req.num_computed_tokens < req.num_tokens:
        n = min(chunk, req.num_tokens - req.num_computed_tokens)
        before = len(kv.get_block_ids("r")[0])
        new = admit(kv, req, n)[1] if first else extend(kv, req, n)
        first = False
        assert new is not None
        total_new += len(new[0])
        blocks = kv.get_block_ids("r")[0]
        assert len(blocks) == math.ceil(req.num_computed_tokens / block_size)
        assert len(blocks) - before == len(new[0])
        assert len(set(blocks)) == len(blocks)
    # Decode tokens: a new block exactly when a block boundary is crossed.
    for step in range(2 * block_size):
        req.all_token_ids.append(7)
        new = extend(kv, req, 1)
        crossed = (req.num_computed_tokens - 1) % block_size == 0
        assert len(new[0]) == (1 if crossed else 0)
        assert len(kv.get_block_ids("r")[0]) == math.ceil(req.num_computed_tokens / block_size)
    assert kv.pool.num_free_blocks == 64 - len(kv.get_block_ids("r")[0])
    kv.free(req)
    assert_no_leak(kv)


def test_allocate_exact_boundaries_block_size_4():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    req = make_req("r", range(20))
    assert len(admit(kv, req, 4)[1][0]) == 1    # tokens 0..3: one full block
    assert len(extend(kv, req, 1)[0]) == 1      # token 4 opens block 2
    assert len(extend(kv, req, 3)[0]) == 0      # tokens 5..7 fill it
    assert len(extend(kv, req, 9)[0]) == 3      # tokens 8..16: blocks 3, 4, and 5 (one token)
    assert len(kv.get_block_ids("r")[0]) == 5
    kv.free(req)
    assert_no_leak(kv)


def test_allocate_returns_none_and_changes_nothing_when_pool_short():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_req("a", range(100, 112))  # 3 blocks
    assert admit(kv, a)[1] is not None
    b = make_req("b", range(200, 209))  # needs 3 blocks, 1 free
    before = snapshot(kv)
    assert admit(kv, b)[1] is None
    assert snapshot(kv) == before
    assert kv.get_block_ids("b")[0] == []
    assert b.num_computed_tokens == 0
    # A running request that needs more than what is free also gets None and keeps its blocks.
    a.all_token_ids.append(1)
    assert extend(kv, a, 1) is not None      # 4th block, pool now full
    a.all_token_ids.append(2)
    a.all_token_ids.append(3)
    a.all_token_ids.append(4)
    a.all_token_ids.append(5)
    before = snapshot(kv)
    assert extend(kv, a, 4) is None          # token 17 needs a 5th block
    assert snapshot(kv) == before
    assert len(kv.get_block_ids("a")[0]) == 4
    kv.free(a)
    kv.free(b)
    assert_no_leak(kv)


def test_free_returns_blocks_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    req = make_req("r", range(12))
    admit(kv, req)
    held = kv.get_block_ids("r")[0]
    kv.free(req)
    queue = [b.block_id for b in kv.pool.free_queue]
    assert queue[-3:] == list(reversed(held)), "the prefix must be the last to be evicted"
    assert kv.get_block_ids("r")[0] == []
    assert_no_leak(kv)


# -- prefix caching ------------------------------------------------------------------------------

def test_prefix_hits_are_whole_blocks_only():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_req("a", range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    assert admit(kv, a)[0] == 0
    a_blocks = kv.get_block_ids("a")[0]

    # Shares 9 tokens (2 full blocks and one more token): 8 tokens hit.
    b = make_req("b", list(range(9)) + [555, 556, 557])
    num_hit, _ = admit(kv, b)
    assert num_hit == 8
    assert kv.get_block_ids("b")[0][:2] == a_blocks[:2]
    assert b.num_computed_tokens == b.num_tokens

    # Shares 6 tokens: only the first block.
    c = make_req("c", list(range(6)) + [900, 901, 902, 903])
    assert admit(kv, c)[0] == 4
    assert kv.get_block_ids("c")[0][0] == a_blocks[0]
    assert kv.get_block_ids("c")[0][1] != a_blocks[1]

    # Shares 3 tokens: nothing.
    d = make_req("d", [0, 1, 2, 777, 778])
    assert admit(kv, d)[0] == 0

    # Same tokens in a later block but a different first block: nothing (the hash is a chain).
    e = make_req("e", [99, 1, 2, 3, 4, 5, 6, 7, 8])
    assert admit(kv, e)[0] == 0

    # Shared blocks carry one reference per holder.
    first = kv.pool.blocks[a_blocks[0]]
    assert first.ref_cnt == 3  # a, b, c
    for r in (a, b, c, d, e):
        kv.free(r)
    assert_no_leak(kv)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_last_prompt_token_is_never_served_from_cache(block_size, k):
    kv = KVCacheManager(num_blocks=32, block_size=block_size, enable_caching=True)
    tokens = list(range(5000, 5000 + k * block_size))
    a = make_req("a", tokens)
    admit(kv, a)
    kv.free(a)
    # The very same prompt: every block is cached, yet the last one can't be used.
    b = make_req("b", tokens)
    num_hit, new = admit(kv, b)
    assert num_hit == (k - 1) * block_size
    assert num_hit < b.num_tokens
    assert new is not None and len(new[0]) == 1
    # One token longer: now all k blocks may be hit.
    c = make_req("c", tokens + [1])
    assert admit(kv, c)[0] == k * block_size
    kv.free(b)
    kv.free(c)
    assert_no_leak(kv)


def test_hits_on_free_cached_blocks_reclaim_them():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_caching=True)
    a = make_req("a", range(100, 113))  # 13 tokens: 4 blocks, 3 full and cached
    admit(kv, a)
    a_blocks = kv.get_block_ids("a")[0]
    kv.free(a)
    assert kv.pool.num_free_blocks == 6

    b = make_req("b", list(range(100, 112)) + [1, 2, 3, 4, 5])  # 17 tokens: 5 blocks, 3 hits
    num_hit, new = admit(kv, b)
    assert num_hit == 12
    assert len(new[0]) == 2
    assert kv.get_block_ids("b")[0][:3] == a_blocks[:3]
    # Three reclaimed from the free queue plus two new: one block left.
    assert kv.pool.num_free_blocks == 1
    for bid in a_blocks[:3]:
        blk = kv.pool.blocks[bid]
        assert blk.ref_cnt == 1 and blk not in list(kv.pool.free_queue)
    kv.free(b)
    assert_no_leak(kv)


def test_reclaimed_hits_count_against_free_capacity():
    # 4 blocks. A leaves 3 cached-but-free blocks; the 4th block is a fresh free block.
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_req("a", range(100, 113))
    admit(kv, a)
    kv.free(a)
    # B hits 3 blocks (all free) and needs 2 more: only 1 block is left once hits are taken.
    b = make_req("b", list(range(100, 112)) + list(range(8)))
    before = snapshot(kv)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is None
    assert snapshot(kv) == before, "a refused allocation must not touch the hit blocks"
    # With exactly one new block needed it fits.
    c = make_req("c", list(range(100, 112)) + [1, 2])
    assert admit(kv, c)[0] == 12
    assert kv.pool.num_free_blocks == 0
    kv.free(c)
    kv.free(b)
    assert_no_leak(kv)


def test_cache_salt_isolates_prefixes():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    tokens = list(range(50, 63))
    admit(kv, a := make_req("a", tokens, salt="alice"))
    assert admit(kv, b := make_req("b", tokens, salt="bob"))[0] == 0
    assert admit(kv, c := make_req("c", tokens))[0] == 0
    assert admit(kv, d := make_req("d", tokens, salt="alice"))[0] == 12
    assert admit(kv, e := make_req("e", tokens, salt="bob"))[0] == 12
    assert admit(kv, f := make_req("f", tokens))[0] == 12
    for r in (a, b, c, d, e, f):
        kv.free(r)
    assert_no_leak(kv)


def test_prefix_stats_count_tokens():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True)
    a = make_req("a", range(10))
    admit(kv, a)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (10, 0)
    b = make_req("b", list(range(9)) + [42])
    admit(kv, b)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (20, 8)
    c = make_req("c", range(5))
    admit(kv, c)
    assert (kv.prefix_stats.queries, kv.prefix_stats.hits) == (25, 12)
    for r in (a, b, c):
        kv.free(r)
    assert_no_leak(kv)


def test_decode_tokens_fill_and_register_blocks():
    # Blocks that become full through generated tokens are cached too, so a later request whose
    # prompt is the earlier prompt + output hits them.
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = make_req("a", [1, 2, 3, 4, 5, 6])
    admit(kv, a)
    for t in (7, 8, 9):
        a.all_token_ids.append(t)
        extend(kv, a, 1)
    kv.free(a)
    b = make_req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert admit(kv, b)[0] == 8
    kv.free(b)
    assert_no_leak(kv)


def test_blocks_stay_cached_after_free_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = make_req("a", range(9))  # 3 blocks, 2 full
    admit(kv, a)
    kv.free(a)
    # Fill the pool with an unrelated request: evicts never-used block then a's tail, then prefix.
    filler = make_req("x", range(1000, 1008))  # 2 blocks
    admit(kv, filler)
    b = make_req("b", range(9))
    assert admit(kv, b)[0] == 8, "the free queue should evict a's tail before its prefix"
    kv.free(b)
    kv.free(filler)
    filler2 = make_req("y", range(2000, 2016))  # all 4 blocks: evicts everything
    admit(kv, filler2)
    kv.free(filler2)
    c = make_req("c", range(9))
    assert admit(kv, c)[0] == 0
    kv.free(c)
    assert_no_leak(kv)


def test_caching_disabled_gives_no_hits_and_no_stats():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=False)
    a = make_req("a", range(13))
    admit(kv, a)
    kv.free(a)
    b = make_req("b", range(13))
    assert admit(kv, b)[0] == 0
    assert kv.pool.cached == {}
    assert all(blk.block_hash is None for blk in kv.pool.blocks)
    kv.free(b)
    assert_no_leak(kv)


def test_reset_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True)
    a = make_req("a", range(9))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    b = make_req("b", range(9))
    assert admit(kv, b)[0] == 0
    kv.free(b)
    assert_no_leak(kv)


def test_free_unknown_request_is_a_no_op():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    kv.free(make_req("ghost", [1, 2, 3]))
    assert_no_leak(kv)
