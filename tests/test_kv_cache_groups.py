"""KV cache groups (pure Python): which layers share blocks, how many blocks a sliding window holds,
the manager giving blocks back past the window and its prefix-cache hit rule per group."""
from __future__ import annotations

import pytest
import transformers
from test_kv_cache_manager import admit, assert_no_leak, extend, make_req

from pagellm.config.arch import layer_sliding_windows
from pagellm.core.kv_cache_groups import block_slots, kv_cache_groups, layer_slots, max_blocks_held, window_blocks
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import SchedulerLimits


def gemma3_windows(num_layers: int, window: int = 1024, pattern: int = 6) -> list[int | None]:
    return [None if (i + 1) % pattern == 0 else window for i in range(num_layers)]


# -- groups ---------------------------------------------------------------------------------------

def test_gemma3_12b_groups_five_sliding_groups_of_eight_beside_the_full_one():
    groups = kv_cache_groups(gemma3_windows(48))
    assert [(g.sliding_window, len(g.layers)) for g in groups] == [(None, 8)] + [(1024, 8)] * 5
    assert groups[0].layers == (5, 11, 17, 23, 29, 35, 41, 47)
    assert groups[1].layers == (0, 1, 2, 3, 4, 6, 7, 8)
    assert block_slots(groups) == 8
    slots = layer_slots(groups)
    assert sorted(slots) == list(range(48)) and slots[11] == (0, 1) and slots[9] == (2, 0)


def test_group_sizes_one_kind_alternating_and_uneven():
    assert [len(g.layers) for g in kv_cache_groups([None] * 32)] == [32]  # Llama: one group as before
    assert [(g.sliding_window, len(g.layers)) for g in kv_cache_groups([4096] * 32)] == [(4096, 32)]  # Mistral
    gemma2 = kv_cache_groups([4096 if i % 2 == 0 else None for i in range(42)])
    assert [(g.sliding_window, len(g.layers)) for g in gemma2] == [(None, 21), (4096, 21)]
    # Gemma-3-1B: 4 full layers, 22 sliding: groups of 4, the last sliding one half used.
    one_b = kv_cache_groups(gemma3_windows(26, 512))
    assert [len(g.layers) for g in one_b] == [4, 4, 4, 4, 4, 4, 2]
    # Counts within 25% share the larger size (a few unused slots, not many groups).
    near = kv_cache_groups([None] * 9 + [64] * 10)
    assert [len(g.layers) for g in near] == [9, 10] and block_slots(near) == 10


def test_blocks_a_window_holds():
    assert window_blocks(1024, 16) == 65  # a decode at a block's first slot reaches back 1023 positions
    assert window_blocks(16, 16) == 2 and window_blocks(17, 16) == 2 and window_blocks(18, 16) == 3
    assert window_blocks(1, 16) == 1
    assert window_blocks(1024, 16, num_new_tokens=512) == 97  # a prompt chunk writes its own blocks too
    assert max_blocks_held(None, 8192, 16) == 512
    assert max_blocks_held(1024, 8192, 16) == 65
    assert max_blocks_held(1024, 100, 16) == 7  # shorter than the window: every block


def test_gemma3_12b_at_8k_holds_the_window_arithmetic():
    groups = kv_cache_groups(gemma3_windows(48))
    limits = SchedulerLimits(max_num_batched_tokens=2048, max_num_seqs=8, max_model_len=8192, block_size=16,
                             num_blocks=2000, enable_prefix_caching=True,
                             sliding_windows=tuple(g.sliding_window for g in groups))
    # 8 full layers keep 512 blocks; 40 sliding layers (5 groups) 65 each: 837 blocks of 8 layers.
    assert limits.blocks_per_request(8192, 1) == 512 + 5 * 65
    assert limits.blocks_per_request(8192) == 512 + 5 * window_blocks(1024, 16, 2048)


def test_a_pool_too_small_for_one_request_names_the_longest_that_fits():
    # 512 blocks of the full group and 9 of the window's (a 64-token chunk after 63 tokens of window).
    with pytest.raises(ValueError, match=r"holds 500 blocks x 16 tokens = 8000 tokens; one request of max_model_len "
                                         r"\(8192\) tokens needs 521 blocks.* at most 7856"):
        SchedulerLimits(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=8192, block_size=16,
                        num_blocks=500, enable_prefix_caching=True, sliding_windows=(None, 64))
    SchedulerLimits(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=7856, block_size=16,
                    num_blocks=500, enable_prefix_caching=True, sliding_windows=(None, 64))


# -- each layer's window, as transformers applies the config -------------------------------------

@pytest.mark.parametrize("config", [
    transformers.Gemma2Config(num_hidden_layers=5, sliding_window=64),
    transformers.Gemma3TextConfig(num_hidden_layers=13, sliding_window=64),
    transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window=64, sliding_window_pattern=3),
    transformers.Qwen2Config(num_hidden_layers=6, use_sliding_window=True, sliding_window=64, max_window_layers=4),
    transformers.Qwen3Config(num_hidden_layers=6, use_sliding_window=True, sliding_window=64, max_window_layers=2),
    transformers.Qwen2MoeConfig(num_hidden_layers=6, use_sliding_window=True, sliding_window=64, max_window_layers=5),
], ids=["gemma2", "gemma3", "gemma3-pattern", "qwen2", "qwen3", "qwen2_moe"])
def test_layer_windows_follow_transformers_layer_types(config):
    d = config.to_dict()
    expected = tuple(64 if kind == "sliding_attention" else None for kind in config.layer_types)
    assert layer_sliding_windows(d) == expected
    d.pop("layer_types")  # an older config.json: the family's default pattern gives the same
    assert layer_sliding_windows(d) == expected
    assert None in expected and 64 in expected


def test_windows_of_families_without_layer_types():
    mistral = transformers.MistralConfig(num_hidden_layers=3, sliding_window=40).to_dict()
    assert layer_sliding_windows(mistral) == (40, 40, 40)
    assert layer_sliding_windows({**mistral, "sliding_window": None}) == (None,) * 3
    qwen = transformers.Qwen2Config(num_hidden_layers=3, sliding_window=40).to_dict()  # use_sliding_window off
    assert layer_sliding_windows({**qwen, "sliding_window": 40, "layer_types": None}) == (None,) * 3
    llama = {**transformers.LlamaConfig(num_hidden_layers=2).to_dict(), "sliding_window": 8}
    assert layer_sliding_windows(llama) == (None, None), "Llama's attention has no window"
    with pytest.raises(ValueError, match="layer_types"):
        layer_sliding_windows({**transformers.Gemma2Config(num_hidden_layers=2).to_dict(), "layer_types": ["x", "y"]})


# -- the manager ----------------------------------------------------------------------------------

WINDOWS = (None, 10)
"""A full-attention group and one of a 10-token window (blocks of 4: the window reaches 4 blocks)."""


def test_a_decoding_sequence_gives_back_blocks_past_the_window():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=False, sliding_windows=WINDOWS)
    req = make_req("r", range(100, 103))
    admit(kv, req)
    held = []
    while req.num_computed_tokens < 80:
        req.all_token_ids.append(7)
        if req.num_computed_tokens + 1 > req.kv_quiet_until:  # as the scheduler calls it
            assert extend(kv, req, 1) is not None
        else:
            req.num_computed_tokens += 1
        held.append(kv.num_blocks_held("r"))
    assert held[-1] == [20, window_blocks(10, 4)]
    assert max(sliding for _, sliding in held) == window_blocks(10, 4) == 4
    assert kv.pool.num_free_blocks == 64 - 20 - 4
    ids = kv.get_block_ids("r")
    assert len(ids[1]) == 20 and ids[1][:16] == [0] * 16  # given back: never read
    kv.free(req)
    assert_no_leak(kv)


def test_a_long_prompt_chunk_is_trimmed_at_the_next_step():
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_caching=True, sliding_windows=WINDOWS)
    req = make_req("r", range(100, 140))  # 40 tokens in one step: 10 blocks in each group
    admit(kv, req)
    assert kv.num_blocks_held("r") == [10, 10]
    assert req.kv_quiet_until == 40, "the next step must not skip the allocation that gives blocks back"
    req.all_token_ids.append(7)
    assert extend(kv, req, 1) is not None
    # Tokens 31..40 are what the token at 40 reads: blocks 7..10.
    assert kv.num_blocks_held("r") == [11, 4]
    kv.free(req)
    assert_no_leak(kv)


def cached_then_freed(kv: KVCacheManager, tokens: list[int]) -> tuple[list, ...]:
    """Compute `tokens` as one request and free it; returns its blocks per group (now cached, free)."""
    req = make_req("first", tokens)
    admit(kv, req)
    blocks = tuple(list(group) for group in kv.req_to_blocks["first"])
    kv.free(req)
    return blocks


def forget(kv: KVCacheManager, block) -> None:
    """Drop a block from the prefix cache, as its eviction does."""
    del kv.pool.cached[block.block_hash]
    block.block_hash = None


PROMPT = list(range(100, 141))
"""41 tokens: 10 full blocks of 4 cached in each group; a hit may reach 40 tokens."""


def test_a_windows_prefix_hit_needs_only_the_blocks_its_window_reaches():
    kv = KVCacheManager(num_blocks=30, block_size=4, enable_caching=True, sliding_windows=WINDOWS)
    full, sliding = cached_then_freed(kv, PROMPT)
    for block in sliding[:7]:  # the window of token 40 reads tokens 31..40: blocks 7..10
        forget(kv, block)
    c = make_req("c", PROMPT + [1, 2])
    hits, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 40
    assert hits[0] == full[:10]
    assert hits[1] == [None] * 7 + sliding[7:10]
    assert admit(kv, c)[0] == 40
    assert kv.num_blocks_held("c") == [11, 4]
    assert kv.get_block_ids("c")[1][:7] == [0] * 7
    kv.free(c)
    assert_no_leak(kv)


@pytest.mark.parametrize("lost,num_hit", [(("sliding", 8), 32), (("sliding", 9), 36), (("full", 3), 12),
                                          (("sliding", 0), 40), (("sliding", 6), 40)])
def test_a_block_lost_where_a_hit_needs_it_moves_the_hit_back(lost, num_hit):
    kv = KVCacheManager(num_blocks=30, block_size=4, enable_caching=True, sliding_windows=WINDOWS)
    full, sliding = cached_then_freed(kv, PROMPT)
    group, index = lost
    forget(kv, (full if group == "full" else sliding)[index])
    hits, got = kv.get_computed_blocks(make_req("c", PROMPT + [1]))
    assert got == num_hit
    first = max(num_hit - 10 + 1, 0) // 4
    assert hits[0] == full[:num_hit // 4] and hits[1] == [None] * first + sliding[first:num_hit // 4]


def test_with_only_windows_a_hit_needs_no_early_block():
    """Mistral's case, every layer windowed: a request that decoded far past its window gave its early
    blocks back; evicted since, they are not needed for a later request to hit its whole history."""
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=True, sliding_windows=(10,))
    a = make_req("a", range(100, 110))
    admit(kv, a)
    early = list(kv.req_to_blocks["a"][0][:3])
    while a.num_computed_tokens < 60:
        a.all_token_ids.append(1000 + a.num_computed_tokens)
        assert extend(kv, a, 1) is not None
    assert kv.num_blocks_held("a")[0] <= window_blocks(10, 4)
    assert all(block.ref_cnt == 0 for block in early)
    history = list(a.all_token_ids)
    kv.free(a)
    for block in early:
        forget(kv, block)
    hits, num_hit = kv.get_computed_blocks(make_req("b", history + [5]))
    assert num_hit == 60 and hits[0][:12] == [None] * 12


def test_groups_cache_their_blocks_under_their_own_keys():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=True, sliding_windows=(None, None))
    a = make_req("a", range(100, 113))
    admit(kv, a)
    ids = kv.get_block_ids("a")
    assert set(ids[0]).isdisjoint(ids[1])
    kv.free(a)
    b = make_req("b", range(100, 113))
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    assert [blk.block_id for blk in hits[0]] == ids[0][:3] and [blk.block_id for blk in hits[1]] == ids[1][:3]


def test_preemption_gives_back_every_group():
    kv = KVCacheManager(num_blocks=40, block_size=4, enable_caching=False, sliding_windows=(None, 10, 10))
    req = make_req("r", range(100, 150))
    admit(kv, req, 16)
    extend(kv, req, 16)
    assert kv.num_blocks_held("r") == [8, 8, 8] or kv.num_blocks_held("r")[1] < 8
    kv.free(req)
    assert_no_leak(kv)
    assert kv.num_blocks_held("r") == [0, 0, 0]
