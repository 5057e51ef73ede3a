"""The Triton attention kernels against the `torch` backend (the oracle), on random inputs.

Without a GPU they run under Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET)
at small sizes; on a GPU the same cases run in bf16 plus full-size ones (long contexts, big batches).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from attn_utils import build_metadata, poison_blocks_before_windows  # noqa: E402

from pagellm.attention import get_attn_backend  # noqa: E402
from pagellm.attention.triton_backend import decode_splits  # noqa: E402
from pagellm.ops.triton import attention as triton_kernels  # noqa: E402
from pagellm.ops.triton.attention import paged_attention  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
# The interpreter computes in float32; on the GPU the kernels run in the serving dtype.
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float32]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def random_paged_batch(shapes: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype, seed: int):
    """Sequences (cached tokens, new tokens) over shuffled blocks of a random cache; returns
    (metadata, query, key, value, (k_cache, v_cache)). Unused cache slots hold random values too."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for (cached, new), n in zip(shapes, blocks_needed):
        seqs.append((cached, new, perm[:n]))
        perm = perm[n:]
    md = build_metadata(seqs, block_size, DEVICE)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = (rand(*cache_shape), rand(*cache_shape))
    return md, rand(md.num_tokens, num_heads, head_dim), rand(md.num_tokens, num_kv_heads, head_dim), \
        rand(md.num_tokens, num_kv_heads, head_dim), cache


def run_both(md, query, key, value, cache, scale: float):
    """(triton output, torch output, triton caches, torch caches) from identical starting caches."""
    tri_cache = tuple(c.clone() for c in cache)
    ref_cache = tuple(c.clone() for c in cache)
    out = get_attn_backend("triton").forward(query, key, value, tri_cache, md, scale)
    ref = get_attn_backend("torch").forward(query, key, value, ref_cache, md, scale)
    return out, ref, tri_cache, ref_cache


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert not out.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(out, ref) < tolerance


MIXED = [(37, 1), (70, 1), (50, 23), (0, 41), (16, 16), (0, 1)]
"""Two decodes, a chunk over a cached prefix, a fresh prompt, a chunk starting on a block
boundary, a one-token prompt."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1), (6, 2)])
@pytest.mark.parametrize("head_dim", [64, pytest.param(128, marks=pytest.mark.slow)])  # interpreted: seconds a case
def test_mixed_batch_matches_torch_backend(dtype, block_size, num_heads, num_kv_heads, head_dim) -> None:
    md, query, key, value, cache = random_paged_batch(
        MIXED, block_size, num_heads, num_kv_heads, head_dim, dtype, seed=block_size + num_heads * 7 + head_dim)
    # A token whose KV is already cached (slot -1) must not be written.
    md.slot_mapping[int(md.query_start_loc_cpu[3])] = -1

    out, ref, tri_cache, ref_cache = run_both(md, query, key, value, cache, head_dim**-0.5)

    assert torch.equal(tri_cache[0], ref_cache[0]) and torch.equal(tri_cache[1], ref_cache[1])
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 4, pytest.param(16, marks=pytest.mark.slow)])  # interpreted: seconds
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 4)])
def test_split_decode_matches_unsplit(dtype, num_splits: int, num_heads: int, num_kv_heads: int) -> None:
    # Contexts shorter than one split, exactly a tile, and spanning many tiles.
    shapes = [(0, 1), (63, 1), (300, 1), (129, 1)]
    md, query, key, value, cache = random_paged_batch(shapes, 16, num_heads, num_kv_heads, 64, dtype, seed=num_splits)
    ref = get_attn_backend("torch").forward(query, key, value, cache, md, 0.125)
    out = torch.full_like(query, float("nan"))

    paged_attention(out, query, *cache, md.block_table, md.seq_lens, md.query_start_loc, 1, 0.125, num_splits)

    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_no_cache_is_causal_within_each_prompt(dtype, num_heads: int, num_kv_heads: int) -> None:
    md, query, key, value, _ = random_paged_batch([(0, 5), (0, 17), (0, 1), (0, 9)], 16, num_heads, num_kv_heads,
                                                  64, dtype, seed=num_heads)

    out = get_attn_backend("triton").forward(query, key, value, None, md, 0.125)
    ref = get_attn_backend("torch").forward(query, key, value, None, md, 0.125)

    check(out, ref, dtype)


WINDOWED = [(37, 1), (70, 1), (50, 23), (0, 41), (100, 3), (5, 2)]
"""Decodes past and within their windows, chunks over a cached prefix, a prompt longer than the window."""


SLOW = pytest.mark.slow  # interpreted: seconds a case


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,soft_cap,num_heads,num_kv_heads", [
    (20, None, 8, 2), (20, 3.0, 8, 2), (1, None, 4, 4),
    pytest.param(64, None, 4, 4, marks=SLOW), pytest.param(64, 3.0, 8, 2, marks=SLOW),
    pytest.param(1, 3.0, 8, 2, marks=SLOW)])
def test_sliding_window_and_soft_cap_match_torch_backend(dtype, window, soft_cap, num_heads, num_kv_heads) -> None:
    """The blocks before each window hold NaN: the kernel must not read them."""
    md, query, key, value, cache = random_paged_batch(WINDOWED, 16, num_heads, num_kv_heads, 64, dtype, seed=window)
    cache = poison_blocks_before_windows(md, WINDOWED, window, 16, cache)
    query = query * 3
    out = get_attn_backend("triton").forward(query, key, value, tuple(c.clone() for c in cache), md, 0.125,
                                             window, soft_cap)
    ref = get_attn_backend("torch").forward(query, key, value, tuple(c.clone() for c in cache), md, 0.125,
                                            window, soft_cap)
    check(out, ref, dtype)
    if soft_cap is None:  # decodes split over programs
        decodes = [(n, 1) for n in (0, 63, 300, 129, 20)]
        md, query, key, value, cache = random_paged_batch(decodes, 16, num_heads, num_kv_heads, 64, dtype, seed=3)
        cache = poison_blocks_before_windows(md, decodes, window, 16, cache)
        ref = get_attn_backend("torch").forward(query, key, value, cache, md, 0.125, window)
        out = torch.full_like(query, float("nan"))
        paged_attention(out, query, *cache, md.block_table, md.seq_lens, md.query_start_loc, 1, 0.125, 4, window)
        check(out, ref, dtype)
    prompts = [(0, 5), (0, 37), (0, 1)]
    md, query, key, value, _ = random_paged_batch(prompts, 16, num_heads, num_kv_heads, 64, dtype, seed=window + 1)
    out = get_attn_backend("triton").forward(query, key, value, None, md, 0.125, window, soft_cap)
    ref = get_attn_backend("torch").forward(query, key, value, None, md, 0.125, window, soft_cap)
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,sink_scale,num_heads,num_kv_heads", [
    (None, 1.0, 8, 2), (20, 30.0, 4, 4), pytest.param(None, 30.0, 8, 2, marks=SLOW),
    pytest.param(20, 1.0, 8, 1, marks=SLOW)])
def test_sinks_match_torch_backend(dtype, window, sink_scale, num_heads, num_kv_heads) -> None:
    """Each head's sink logit joins its softmax (added at the end of the online softmax, or when split
    decodes merge), whether it sits below the scores or far above them."""
    sinks = (torch.randn(num_heads, generator=torch.Generator().manual_seed(2)) * sink_scale).to(DEVICE, dtype)
    md, query, key, value, cache = random_paged_batch(WINDOWED, 16, num_heads, num_kv_heads, 64, dtype, seed=11)
    if window is not None:
        cache = poison_blocks_before_windows(md, WINDOWED, window, 16, cache)
    out = get_attn_backend("triton").forward(query, key, value, tuple(c.clone() for c in cache), md, 0.125,
                                             window, None, sinks)
    ref = get_attn_backend("torch").forward(query, key, value, tuple(c.clone() for c in cache), md, 0.125,
                                            window, None, sinks)
    check(out, ref, dtype)
    decodes = [(n, 1) for n in (0, 63, 300, 129, 20)]
    md, query, key, value, cache = random_paged_batch(decodes, 16, num_heads, num_kv_heads, 64, dtype, seed=3)
    ref = get_attn_backend("torch").forward(query, key, value, cache, md, 0.125, window, None, sinks)
    out = torch.full_like(query, float("nan"))
    paged_attention(out, query, *cache, md.block_table, md.seq_lens, md.query_start_loc, 1, 0.125, 4, window,
                    sinks=sinks)
    check(out, ref, dtype)
    prompts = [(0, 5), (0, 37), (0, 1)]
    md, query, key, value, _ = random_paged_batch(prompts, 16, num_heads, num_kv_heads, 64, dtype, seed=4)
    out = get_attn_backend("triton").forward(query, key, value, None, md, 0.125, window, None, sinks)
    ref = get_attn_backend("torch").forward(query, key, value, None, md, 0.125, window, None, sinks)
    check(out, ref, dtype)


def test_large_decode_batch_tiles_match_torch_backend(monkeypatch) -> None:
    # The "large_decode" tiles, taken here by a small batch so that the interpreter can run it.
    monkeypatch.setattr(triton_kernels, "LARGE_DECODE_PROGRAMS", 8)
    shapes = [(0, 1), (127, 1), (300, 1), (129, 1)]
    md, query, key, value, cache = random_paged_batch(shapes, 16, 8, 2, 128, DTYPES[0], seed=5)
    out, ref, _, _ = run_both(md, query, key, value, cache, 128**-0.5)
    check(out, ref, DTYPES[0])


def test_padding_slots_are_not_written() -> None:
    md, query, key, value, cache = random_paged_batch([(5, 3), (0, 2)], 16, 4, 2, 64, DTYPES[0], seed=3)
    md.slot_mapping[:] = -1
    before = tuple(c.clone() for c in cache)

    get_attn_backend("triton").forward(query, key, value, cache, md, 0.125)

    assert torch.equal(cache[0], before[0]) and torch.equal(cache[1], before[1])


def test_decode_splits_fill_the_gpu_and_depend_on_batch_shape_only() -> None:
    assert decode_splits(1, 8) == 16  # batch 1 of Llama-3.1-8B: 8 KV heads x 16 ranges
    assert decode_splits(256, 8) == 1
    assert all(decode_splits(b, 8) * b * 8 >= 264 or decode_splits(b, 8) == 16 for b in range(1, 64))


@pytest.mark.skipif(not ON_GPU, reason="full-size shapes need a GPU (the interpreter is too slow)")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 8), (32, 32), (28, 4)])
def test_full_size_long_contexts_on_gpu(num_heads: int, num_kv_heads: int) -> None:
    # A 4k-token prefill chunk over a 4k cached prefix, long decodes and a big decode batch.
    shapes = [(4096, 4096), (8000, 1), (16000, 1)] + [(int(n), 1) for n in torch.randint(1, 3000, (61,))]
    md, query, key, value, cache = random_paged_batch(shapes, 16, num_heads, num_kv_heads, 128, torch.bfloat16, seed=1)
    out, ref, tri_cache, ref_cache = run_both(md, query, key, value, cache, 128**-0.5)
    assert torch.equal(tri_cache[0], ref_cache[0])
    check(out, ref, torch.bfloat16)
    decodes = [(int(n), 1) for n in torch.randint(1, 32000, (8,))]
    md, query, key, value, cache = random_paged_batch(decodes, 16, num_heads, num_kv_heads, 128, torch.bfloat16, seed=2)
    out, ref, _, _ = run_both(md, query, key, value, cache, 128**-0.5)
    check(out, ref, torch.bfloat16)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp8_cache_scales_divide_what_is_stored(backend: str) -> None:
    """A layer's per-tensor KV scales (a checkpoint's calibrated k_scale / v_scale): the float8
    cache holds key / k_scale and value / v_scale, and attention equals attention over a cache in
    the model's dtype holding what was stored times the scales."""
    from pagellm.attention.layer import Attention

    dtype, (num_heads, num_kv_heads, head_dim) = DTYPES[0], (8, 2, 64)
    md, query, key, value, cache = random_paged_batch(MIXED, 16, num_heads, num_kv_heads, head_dim, dtype, seed=3)
    layer = Attention(num_heads, num_kv_heads, head_dim, 0.125, get_attn_backend(backend))
    layer.load_kv_scale("k_scale", torch.tensor(0.37))
    layer.load_kv_scale("v_scale", torch.tensor([2.5]))
    layer.kv_cache = tuple(c.to(torch.float8_e4m3fn) for c in cache)
    out = layer(query, key, value, md).view_as(query)
    stored = (layer.kv_cache[0].to(dtype) * 0.37, layer.kv_cache[1].to(dtype) * 2.5)
    rows = [c.view(-1, num_kv_heads, head_dim)[md.slot_mapping.long()] for c in stored]
    assert relative_error(rows[0], key) < 0.1 and relative_error(rows[1], value) < 0.1  # the step's rows, divided
    ref = get_attn_backend("torch").forward(query, *rows, stored, md, 0.125)
    check(out, ref, dtype)


@pytest.mark.parametrize("f16_dots", [False, True])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (6, 2)])
def test_fp8_cache_matches_torch_backend(num_heads, num_kv_heads, f16_dots, monkeypatch) -> None:
    """--kv-cache-dtype fp8: both backends write the step's K/V rounded to float8 and attend over
    the float8 cache widened to the queries' type (or, with the kernel's `f16_dots`, to float16,
    as the queries are); the torch backend on such a cache is exactly the torch backend on a
    16/32-bit cache holding the rounded values."""
    from pagellm.ops.triton import attention as triton_kernels

    for kind in triton_kernels.TUNING:
        monkeypatch.setitem(triton_kernels.TUNING, kind, {**triton_kernels.TUNING[kind], "f16_dots": f16_dots})
    dtype = DTYPES[0]
    md, query, key, value, cache = random_paged_batch(MIXED, 16, num_heads, num_kv_heads, 64, dtype, seed=num_heads)
    fp8_cache = tuple(c.to(torch.float8_e4m3fn) for c in cache)
    rounded = tuple(c.to(dtype) for c in fp8_cache)
    ref = get_attn_backend("torch").forward(query, key, value, fp8_cache, md, 0.125)
    widened = get_attn_backend("torch").forward(query, key.to(torch.float8_e4m3fn).to(dtype),
                                                value.to(torch.float8_e4m3fn).to(dtype), rounded, md, 0.125)
    torch.testing.assert_close(ref, widened, atol=0, rtol=0)
    torch.testing.assert_close(fp8_cache[0].to(dtype), rounded[0], atol=0, rtol=0)  # same entries written
    if ON_GPU:  # the write kernel rounds as PyTorch does (Triton's interpreter does not, near exponent steps)
        tri_cache = tuple(c.to(torch.float8_e4m3fn) for c in cache)
        out = get_attn_backend("triton").forward(query, key, value, tri_cache, md, 0.125)
        assert torch.equal(tri_cache[0].view(torch.uint8), fp8_cache[0].view(torch.uint8))
    else:  # the read path: attention over the cache the torch backend wrote
        out = torch.empty_like(query)
        paged_attention(out, query, *fp8_cache, md.block_table, md.seq_lens, md.query_start_loc,
                        md.max_query_len, 0.125)
    check(out, ref, torch.float16 if f16_dots else dtype)


# Interpreted, each case takes seconds: one runs in the quick tier, the others are slow.
@pytest.mark.parametrize("cache_dtype", [None, pytest.param(torch.float8_e4m3fn, marks=pytest.mark.slow)])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), pytest.param(6, 3, marks=pytest.mark.slow)])
def test_rotary_fused_with_the_kv_write_matches_both_kernels_and_the_torch_backend(cache_dtype, num_heads: int,
                                                                                  num_kv_heads: int,
                                                                                  monkeypatch) -> None:
    """A layer handing the rotary embedding to the Triton backend gets one launch for the rotation
    and the KV write: the cache and the output equal those of the rotary kernel, then the write
    kernel (bit for bit, a float8 cache too), and match the torch backend's; q, k and v are views
    of one fused projection, and a token whose slot is -1 (already cached) is not written."""
    from pagellm.attention import triton_backend
    from pagellm.attention.layer import Attention
    from pagellm.layers.rotary import RotaryEmbedding
    from pagellm.ops.triton import rotary as triton_rotary

    dtype, head_dim = DTYPES[0], 64
    md, query, key, value, cache = random_paged_batch(MIXED, 16, num_heads, num_kv_heads, head_dim, dtype, seed=9)
    unwritten, written = int(md.slot_mapping[1]), int(md.slot_mapping[0])
    md.slot_mapping[1] = -1
    qkv = torch.cat([t.flatten(1) for t in (query, key, value)], dim=1)
    query, key, value = (t.view(md.num_tokens, -1, head_dim) for t in qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1))
    lens = md.query_start_loc_cpu[1:] - md.query_start_loc_cpu[:-1]
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(md.seq_lens_cpu, lens)]).to(DEVICE)
    rotary = RotaryEmbedding(head_dim, 1024, 10000.0).to(DEVICE)
    if cache_dtype is not None:
        cache = tuple(c.to(cache_dtype) for c in cache)
    runs = {}
    for name, backend in (("fused", "triton"), ("torch", "torch")):
        layer = Attention(num_heads, num_kv_heads, head_dim, 0.125, get_attn_backend(backend))
        layer.kv_cache = tuple(c.clone() for c in cache)
        with monkeypatch.context() as patch:
            if name == "fused":  # neither the rotary kernel nor the write kernel runs
                patch.setattr(RotaryEmbedding, "forward", None)
                patch.setattr(triton_backend, "write_kv", None)
            runs[name] = (layer(query, key, value, md, rotary, positions), layer.kv_cache)
    q_rot, k_rot = triton_rotary.rotary_embedding(positions, query, key, rotary.cos_sin_cache)
    two_kernels = tuple(c.clone() for c in cache)
    runs["two kernels"] = (get_attn_backend("triton").forward(q_rot, k_rot, value, two_kernels, md, 0.125)
                           .flatten(1), two_kernels)

    (out, (k_cache, v_cache)), (out2, (k2, v2)) = runs["fused"], runs["two kernels"]
    assert torch.equal(out, out2)
    assert torch.equal(k_cache.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v2.view(torch.uint8))
    for new, old in zip((k_cache, v_cache), cache):
        slots, before = new.view(-1, num_kv_heads, head_dim), old.view(-1, num_kv_heads, head_dim)
        assert torch.equal(slots[unwritten].view(torch.uint8), before[unwritten].view(torch.uint8))
        assert not torch.equal(slots[written].view(torch.uint8), before[written].view(torch.uint8))
    if cache_dtype is None:
        check(out.view_as(query), runs["torch"][0].view_as(query), dtype)
        torch.testing.assert_close(k_cache, runs["torch"][1][0], atol=1e-5, rtol=1e-5)
