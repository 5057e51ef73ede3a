"""Block hashing, the O(1) free-block queue and the block pool (pure Python, no torch)."""
from __future__ import annotations

import pytest

from pagellm.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from pagellm.core.hashing import extend_block_hashes, hash_block


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def assert_all_free(pool: BlockPool) -> None:
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert sorted(ids(pool.free_queue)) == list(range(pool.num_blocks))
    assert pool.usage == 0.0


# -- hashing -------------------------------------------------------------------------------------

def test_hash_is_deterministic_for_same_parent_and_tokens():
    parent = hash_block(None, [1, 2, 3, 4])
    assert hash_block(parent, [5, 6, 7, 8]) == hash_block(parent, [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == parent
    # Accepts any sequence of ints: list and tuple of the same tokens name the same block.
    assert hash_block(parent, (5, 6, 7, 8)) == hash_block(parent, [5, 6, 7, 8])


def test_hash_depends_on_parent_tokens_and_extra_keys():
    root_a = hash_block(None, [1, 2, 3, 4])
    root_b = hash_block(None, [1, 2, 3, 5])
    assert root_a != root_b
    tokens = [9, 9, 9, 9]
    base = hash_block(root_a, tokens)
    assert hash_block(root_b, tokens) != base, "a different parent must give a different hash"
    assert hash_block(None, tokens) != base, "no parent differs from a parent"
    assert hash_block(root_a, [9, 9, 9, 8]) != base, "a different token must give a different hash"
    assert hash_block(root_a, [9, 9, 8, 9]) != base
    assert hash_block(root_a, tokens, ("salt-a",)) != base, "a salt must change the hash"
    assert hash_block(root_a, tokens, ("salt-a",)) != hash_block(root_a, tokens, ("salt-b",))
    assert hash_block(root_a, tokens, ("salt-a",)) == hash_block(root_a, tokens, ("salt-a",))
    # Token order matters, and large token ids are not truncated into each other.
    assert hash_block(None, [1, 2]) != hash_block(None, [2, 1])
    assert hash_block(None, [2**32]) != hash_block(None, [0])


def test_hash_is_a_chain_over_the_whole_prefix():
    # Same second block after different first blocks: the second hashes must differ.
    a: list[bytes] = []
    b: list[bytes] = []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    extend_block_hashes(b, [1, 2, 3, 0, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]
    assert a[1] == hash_block(a[0], [5, 6, 7, 8])


def test_extend_hashes_only_full_blocks():
    hashes: list[bytes] = []
    extend_block_hashes(hashes, [1, 2, 3], 4)
    assert hashes == []
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7], 4)
    assert hashes == [hash_block(None, [1, 2, 3, 4])]


def test_extend_hashes_is_incremental_and_matches_one_shot():
    tokens = list(range(100, 123))  # 5 full blocks of 4, plus 3 tokens
    one_shot: list[bytes] = []
    extend_block_hashes(one_shot, tokens, 4, ("s",))
    assert len(one_shot) == 5

    incremental: list[bytes] = []
    for n in range(len(tokens) + 1):
        before = list(incremental)
        extend_block_hashes(incremental, tokens[:n], 4, ("s",))
        # Existing entries are never recomputed or replaced; new ones appear only per full block.
        assert incremental[:len(before)] == before
        assert len(incremental) == n // 4
    assert incremental == one_shot


def test_extend_hashes_does_not_rehash_existing_entries():
    # Incremental: a list already holding hashes is extended, not recomputed. A sentinel in the
    # first slot survives, and the next hash chains on the sentinel.
    sentinel = b"x" * 32
    hashes = [sentinel]
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert hashes == [sentinel, hash_block(sentinel, [5, 6, 7, 8])]


# -- FreeBlockQueue ------------------------------------------------------------------------------

def test_free_queue_fifo_order_remove_and_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5
    assert ids(q) == [0, 1, 2, 3, 4]

    q.remove(blocks[2])  # from the middle
    assert ids(q) == [0, 1, 3, 4] and q.num_free == 4
    assert blocks[2].prev_free is None and blocks[2].next_free is None

    q.remove(blocks[0])  # the head
    q.remove(blocks[4])  # the tail
    assert ids(q) == [1, 3] and q.num_free == 2

    q.append(blocks[4])
    q.append(blocks[0])
    q.append(blocks[2])
    assert ids(q) == [1, 3, 4, 0, 2] and q.num_free == 5

    popped = [q.popleft().block_id for _ in range(5)]
    assert popped == [1, 3, 4, 0, 2]
    assert q.num_free == 0 and ids(q) == []
    with pytest.raises(ValueError):
        q.popleft()

    q.append(blocks[3])
    assert ids(q) == [3] and q.popleft() is blocks[3]


def test_free_queue_remove_only_element_then_reuse():
    b = KVCacheBlock(7)
    q = FreeBlockQueue([b])
    q.remove(b)
    assert q.num_free == 0 and list(q) == []
    q.append(b)
    assert list(q) == [b]


# -- BlockPool -----------------------------------------------------------------------------------

def test_pool_rejects_empty():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_takes_least_recently_freed_and_sets_ref_count():
    pool = BlockPool(6)
    a = pool.allocate(2)
    assert all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 4
    # Free in a chosen order; those become the most recently freed, after the never-used ones.
    pool.free([a[1], a[0]])
    order = ids(pool.allocate(6))
    assert order[:4] == [b for b in range(6) if b not in ids(a)]
    assert order[4:] == [a[1].block_id, a[0].block_id]
    assert pool.num_free_blocks == 0
    assert pool.usage == 1.0


def test_allocate_over_capacity_raises_and_changes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert [b.ref_cnt for b in held] == [1, 1, 1]
    assert pool.allocate(0) == []
    pool.free(held)
    assert_all_free(pool)


def test_usage_fraction():
    pool = BlockPool(8)
    assert pool.usage == 0.0
    a = pool.allocate(2)
    assert pool.usage == pytest.approx(2 / 8)
    b = pool.allocate(4)
    assert pool.usage == pytest.approx(6 / 8)
    pool.free(a)
    assert pool.usage == pytest.approx(4 / 8)
    # A cached-but-free block counts as free.
    pool.cache_block(b[0], b"h0")
    pool.free(b)
    assert pool.usage == 0.0
    assert_all_free(pool)


def test_cached_block_is_findable_after_free_and_evicted_on_allocation():
    pool = BlockPool(3)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, b"hash-A")
    assert pool.get_cached_block(b"hash-A") is blk
    pool.free([blk])
    # Freed blocks keep their hash until reused.
    assert pool.get_cached_block(b"hash-A") is blk
    assert blk.block_hash == b"hash-A"
    # Two never-used blocks are evicted before the cached one (it was freed last).
    first_two = pool.allocate(2)
    assert blk not in first_two
    assert pool.get_cached_block(b"hash-A") is blk
    (again,) = pool.allocate(1)
    assert again is blk
    assert again.block_hash is None
    assert pool.get_cached_block(b"hash-A") is None
    assert b"hash-A" not in pool.cached
    pool.free(first_two + [again])
    assert_all_free(pool)


def test_cache_block_first_writer_wins():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.get_cached_block(b"same") is a
    assert b.block_hash is None
    # A block that already has a hash keeps it.
    pool.cache_block(a, b"other")
    assert a.block_hash == b"same"
    assert pool.get_cached_block(b"other") is None
    # Evicting b (no hash) must not drop a's entry.
    pool.free([b])
    pool.allocate(3)
    assert pool.get_cached_block(b"same") is a


def test_touch_removes_free_cached_block_from_queue_and_shares_it():
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, b"h")
    pool.free([blk])
    assert blk.ref_cnt == 0 and blk in list(pool.free_queue)
    assert pool.num_free_blocks == 4

    pool.touch([blk])
    assert blk.ref_cnt == 1
    assert blk not in list(pool.free_queue)
    assert pool.num_free_blocks == 3
    # A touched block can't be handed out by allocate.
    others = pool.allocate(3)
    assert blk not in others
    with pytest.raises(ValueError):
        pool.allocate(1)

    # Touching an in-use block only adds a reference.
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free([blk])
    assert blk.ref_cnt == 1 and blk not in list(pool.free_queue)
    pool.free([blk])
    assert blk.ref_cnt == 0 and list(pool.free_queue)[-1] is blk
    pool.free(others)
    assert_all_free(pool)
    assert pool.get_cached_block(b"h") is blk


def test_tail_first_free_evicts_tail_before_prefix():
    pool = BlockPool(4)
    req = pool.allocate(4)  # a request's blocks, prefix first
    for i, b in enumerate(req):
        pool.cache_block(b, f"h{i}".encode())
    pool.free(reversed(req))
    # The next allocation evicts the request's last block first, and its first block last.
    (victim,) = pool.allocate(1)
    assert victim is req[-1]
    assert pool.get_cached_block(b"h3") is None
    for i in range(3):
        assert pool.get_cached_block(f"h{i}".encode()) is req[i]
    rest = pool.allocate(3)
    assert rest == [req[2], req[1], req[0]]
    pool.free(rest + [victim])
    assert_all_free(pool)


def test_reset_prefix_cache_only_when_everything_free():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"ha")
    pool.cache_block(b, b"hb")
    pool.free([b])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"ha") is a and pool.get_cached_block(b"hb") is b
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(blk.block_hash is None for blk in pool.blocks)
    assert pool.get_cached_block(b"ha") is None
    assert_all_free(pool)
