"""The pure-PyTorch paged attention backend against a plainly written reference."""
from __future__ import annotations

import pytest
import torch
from attn_utils import build_metadata, poison_blocks_before_windows

from pagellm.attention import get_attn_backend
from pagellm.attention.layer import Attention
from pagellm.distributed import init_tensor_parallel


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float,
    window: int | None = None, soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, H, D] at positions first_pos.. ; k, v [L, Hkv, D] for positions 0..L-1 -> [n, H, D];
    the query at p sees the keys p - window < j <= p (all j <= p without a window), its scores
    capped to soft_cap * tanh(s / soft_cap); head h's softmax has one more logit, sinks[h], whose
    weight is dropped (transformers' GPT-OSS eager attention)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])[:, None]
    key_pos = torch.arange(k.shape[0])[None, :]
    hidden = (key_pos > q_pos) | (key_pos <= q_pos - window if window is not None else False)
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        column = sinks[:, None, None].expand(-1, scores.shape[1], 1)
        return torch.einsum("hqk,khd->qhd", torch.cat((scores, column), dim=-1).softmax(-1)[..., :-1], v)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_mixed_batch_matches_reference(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 1000 + num_heads * 10 + head_dim)
    num_blocks = 24
    # (tokens already cached, new tokens): two decodes, a chunk continuing a cached prefix, a fresh prompt.
    shapes = [(37, 1), (70, 1), (50, 23), (0, 41)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for cached, new in shapes:
        n = -(-(cached + new) // block_size)
        seqs.append((cached, new, perm[:n]))
        perm = perm[n:]
    md = build_metadata(seqs, block_size)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in shapes]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in shapes]
    for (cached, _, blocks), k, v in zip(seqs, full_k, full_v):
        for pos in range(cached):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
    key = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v)])
    query = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen)

    # The fresh prompt's first token is already cached (slot -1): its input K/V is garbage that
    # must neither be written nor attended to.
    skipped_row = int(md.query_start_loc_cpu[3])
    skipped_slot = int(md.slot_mapping[skipped_row])
    k_cache.view(-1, num_kv_heads, head_dim)[skipped_slot] = full_k[3][0]
    v_cache.view(-1, num_kv_heads, head_dim)[skipped_slot] = full_v[3][0]
    md.slot_mapping[skipped_row] = -1
    key[skipped_row] = 1e3
    value[skipped_row] = 1e3

    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    valid = md.slot_mapping >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[md.slot_mapping[valid]] = key[valid]
    expected_v.view(-1, num_kv_heads, head_dim)[md.slot_mapping[valid]] = value[valid]

    scale = head_dim**-0.5
    out = get_attn_backend("torch").forward(query, key, value, (k_cache, v_cache), md, scale)

    assert out.shape == query.shape
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    for i, (cached, new) in enumerate(shapes):
        rows = slice(int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1]))
        ref = reference_attention(query[rows], full_k[i], full_v[i], cached, scale)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_no_cache_is_causal_within_each_prompt(num_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator().manual_seed(7)
    head_dim = 64
    lens = [5, 17, 1, 9]
    md = build_metadata([(0, n, [0, 1]) for n in lens], block_size=16)
    query = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(md.num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(md.num_tokens, num_kv_heads, head_dim, generator=gen)

    out = get_attn_backend("torch").forward(query, key, value, None, md, 0.125)

    for i in range(len(lens)):
        rows = slice(int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1]))
        ref = reference_attention(query[rows], key[rows], value[rows], 0, 0.125)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("soft_cap", [None, 3.0])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_sliding_window_and_soft_cap_match_reference(window: int, soft_cap: float | None, num_heads: int,
                                                     num_kv_heads: int) -> None:
    """Decodes and prompt chunks (some longer than the window) over a paged cache whose blocks before
    each window are unreadable; and the same prompts from position 0 without a cache."""
    gen = torch.Generator().manual_seed(window * 10 + num_heads)
    block_size, head_dim = 16, 64
    shapes = [(37, 1), (70, 1), (50, 23), (0, 41), (16, 16), (100, 3)]
    needed = [-(-(c + n) // block_size) for c, n in shapes]
    num_blocks = sum(needed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = []
    for (cached, new), n in zip(shapes, needed):
        seqs.append((cached, new, perm[:n]))
        perm = perm[n:]
    md = build_metadata(seqs, block_size)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(cache_shape), torch.zeros(cache_shape)
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in shapes]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in shapes]
    for (cached, _, blocks), k, v in zip(seqs, full_k, full_v):
        for pos in range(cached):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
    k_cache, v_cache = poison_blocks_before_windows(md, shapes, window, block_size, (k_cache, v_cache))
    key = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v)])
    query = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen) * 3
    scale = head_dim**-0.5

    out = get_attn_backend("torch").forward(query, key, value, (k_cache, v_cache), md, scale, window, soft_cap)

    for i, (cached, new) in enumerate(shapes):
        rows = slice(int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1]))
        ref = reference_attention(query[rows], full_k[i], full_v[i], cached, scale, window, soft_cap)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)
    prompts = build_metadata([(0, c + n, [0]) for c, n in shapes], 1000)
    query = torch.randn(prompts.num_tokens, num_heads, head_dim, generator=gen) * 3
    key, value = torch.cat(full_k), torch.cat(full_v)
    out = get_attn_backend("torch").forward(query, key, value, None, prompts, scale, window, soft_cap)
    for i, k in enumerate(full_k):
        rows = slice(int(prompts.query_start_loc_cpu[i]), int(prompts.query_start_loc_cpu[i + 1]))
        ref = reference_attention(query[rows], k, full_v[i], 0, scale, window, soft_cap)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,soft_cap", [(None, None), (7, None), (16, 3.0)])
@pytest.mark.parametrize("sink_scale", [1.0, 20.0])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2)])
def test_sinks_match_reference(window: int | None, soft_cap: float | None, sink_scale: float, num_heads: int,
                               num_kv_heads: int) -> None:
    """Each head's sink logit joins its softmax: over a paged cache (decodes, chunks) and without one,
    with or beside a window and a soft cap; sinks from well below to well above the scores."""
    gen = torch.Generator().manual_seed(num_heads + int(sink_scale))
    block_size, head_dim = 16, 32
    shapes = [(37, 1), (50, 23), (0, 41), (5, 2)]
    needed = [-(-(c + n) // block_size) for c, n in shapes]
    perm = torch.randperm(sum(needed), generator=gen).tolist()
    seqs = []
    for (cached, new), n in zip(shapes, needed):
        seqs.append((cached, new, perm[:n]))
        perm = perm[n:]
    md = build_metadata(seqs, block_size)
    full_k = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in shapes]
    full_v = [torch.randn(c + n, num_kv_heads, head_dim, generator=gen) for c, n in shapes]
    k_cache = torch.zeros(sum(needed), block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    for (cached, _, blocks), k, v in zip(seqs, full_k, full_v):
        for pos in range(cached):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
    key = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v)])
    query = torch.randn(md.num_tokens, num_heads, head_dim, generator=gen)
    sinks = torch.randn(num_heads, generator=gen) * sink_scale
    scale = head_dim**-0.5
    backend = get_attn_backend("torch")

    out = backend.forward(query, key, value, (k_cache, v_cache), md, scale, window, soft_cap, sinks)
    for i, (cached, _) in enumerate(shapes):
        rows = slice(int(md.query_start_loc_cpu[i]), int(md.query_start_loc_cpu[i + 1]))
        ref = reference_attention(query[rows], full_k[i], full_v[i], cached, scale, window, soft_cap, sinks)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, backend.forward(query, key, value, (k_cache, v_cache), md, scale, window,
                                                   soft_cap), atol=1e-3)
    prompts = build_metadata([(0, c + n, [0]) for c, n in shapes], 1000)
    query = torch.randn(prompts.num_tokens, num_heads, head_dim, generator=gen)
    out = backend.forward(query, torch.cat(full_k), torch.cat(full_v), None, prompts, scale, window, soft_cap, sinks)
    for i, k in enumerate(full_k):
        rows = slice(int(prompts.query_start_loc_cpu[i]), int(prompts.query_start_loc_cpu[i + 1]))
        ref = reference_attention(query[rows], k, full_v[i], 0, scale, window, soft_cap, sinks)
        torch.testing.assert_close(out[rows], ref, atol=1e-5, rtol=1e-5)


def test_attention_layer_loads_its_ranks_sinks() -> None:
    """The sinks parameter holds this rank's heads of the model's, and the backend gets it."""
    whole = torch.arange(8.0)
    layers = []
    for rank in range(2):
        init_tensor_parallel(rank, 2)
        try:
            layer = Attention(4, 2, 32, 0.125, get_attn_backend("torch"), sinks=True)
            layer.sinks.weight_loader(layer.sinks, whole)
        finally:
            init_tensor_parallel(0, 1)
        layers.append(layer)
    assert layers[1].sinks.tolist() == [4.0, 5.0, 6.0, 7.0]
    with pytest.raises(ValueError, match=r"attention sinks of shape \(4,\): expected \(8,\)"):
        init_tensor_parallel(1, 2)
        try:
            layers[1].sinks.weight_loader(layers[1].sinks, whole[:4])
        finally:
            init_tensor_parallel(0, 1)
    md = build_metadata([(0, 6, [0])], block_size=16)
    query, key, value = torch.randn(6, 128), torch.randn(6, 64), torch.randn(6, 64)
    expected = reference_attention(query.view(6, 4, 32), key.view(6, 2, 32), value.view(6, 2, 32), 0, 0.125,
                                   sinks=layers[1].sinks)
    torch.testing.assert_close(layers[1](query, key, value, md), expected.reshape(6, 128))
    assert Attention(4, 2, 32, 0.125, get_attn_backend("torch")).sinks is None


def test_layers_of_two_windows_share_one_steps_metadata() -> None:
    """A full layer and a windowed one over the same metadata: each plans its own groups."""
    md = build_metadata([(40, 2, [0, 1, 2])], block_size=16)
    cache = (torch.randn(3, 16, 2, 64), torch.randn(3, 16, 2, 64))
    query, key, value = torch.randn(2, 4, 64), torch.randn(2, 2, 64), torch.randn(2, 2, 64)
    backend = get_attn_backend("torch")
    full = backend.forward(query, key, value, cache, md, 0.125)
    windowed = backend.forward(query, key, value, cache, md, 0.125, 4)
    k, v = cache[0].view(-1, 2, 64)[:42], cache[1].view(-1, 2, 64)[:42]
    torch.testing.assert_close(full, reference_attention(query, k, v, 40, 0.125))
    torch.testing.assert_close(windowed, reference_attention(query, k, v, 40, 0.125, 4))


def test_padding_rows_past_num_tokens_are_zero() -> None:
    md = build_metadata([(3, 2, [1]), (0, 1, [0])], block_size=16)
    cache = (torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64))
    # Two padding rows after the 3 real tokens, as a captured batch shape would add.
    query, key, value = torch.randn(5, 4, 64), torch.randn(5, 2, 64), torch.randn(5, 2, 64)

    out = get_attn_backend("torch").forward(query, key, value, cache, md, 0.125)

    assert out[3:].abs().sum() == 0
    assert out[:3].abs().sum() > 0


def test_attention_layer_flattens_heads_and_uses_bound_cache() -> None:
    md = build_metadata([(0, 6, [2])], block_size=16)
    layer = Attention(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125, backend=get_attn_backend("torch"))
    query, key, value = torch.randn(6, 256), torch.randn(6, 128), torch.randn(6, 128)
    without_cache = layer(query, key, value, md)
    layer.kv_cache = (torch.zeros(3, 16, 2, 64), torch.zeros(3, 16, 2, 64))

    with_cache = layer(query, key, value, md)

    assert with_cache.shape == (6, 256)
    torch.testing.assert_close(with_cache, without_cache)
    torch.testing.assert_close(layer.kv_cache[0][2, :6], key.view(6, 2, 64))


def test_unknown_backend_lists_valid_names() -> None:
    with pytest.raises(ValueError, match="torch"):
        get_attn_backend("flash")
