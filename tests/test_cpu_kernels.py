"""The C kernels of the CPU path (`pagellm/ops/c/cpu_kernels.c`) against their PyTorch versions:
the small ops, and the `cpu` attention backend against the `torch` one."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from attn_utils import build_metadata, poison_blocks_before_windows

from pagellm import ops
from pagellm.attention import get_attn_backend
from pagellm.layers import RotaryEmbedding
from pagellm.ops.c import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the C kernels do not build here")
CLOSE = dict(rtol=1e-5, atol=1e-5)  # float32: only the order of additions and expf differ


def randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (5, 100), (3, 64)])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
def test_norms_match_torch_and_leave_inputs(tokens, hidden, strided):
    pad = 8 if strided else 0
    x = randn(1, tokens, hidden + pad)[:, :hidden]
    residual = randn(2, tokens, hidden + pad)[:, pad:]
    weight = randn(3, hidden) + 1
    before = x.clone(), residual.clone()
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5, impl="cpu"), ops.rms_norm(x, weight, 1e-5, impl="torch"),
                               **CLOSE)
    got = ops.fused_add_rms_norm(x, residual, weight, 1e-5, impl="cpu")
    want = ops.fused_add_rms_norm(x, residual, weight, 1e-5, impl="torch")
    torch.testing.assert_close(got, want, **CLOSE)
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])


@pytest.mark.parametrize("tokens,intermediate", [(1, 1536), (4, 37)])
def test_silu_and_mul_matches_torch(tokens, intermediate):
    x = randn(4, tokens, 2 * intermediate) * 3  # silu's negative tail, bend and linear part
    torch.testing.assert_close(ops.silu_and_mul(x, impl="cpu"), ops.silu_and_mul(x, impl="torch"), **CLOSE)


def test_silu_and_mul_saturates_like_torch():
    """The vectorized exp clamps its input: far tails must still give silu's limits (0 and g)."""
    g = torch.tensor([-1e4, -200.0, -88.5, -87.0, -20.0, 0.0, 20.0, 87.0, 88.5, 200.0, 1e4, 3.5] * 2)
    x = torch.cat((g, torch.linspace(-2, 2, len(g)))).reshape(1, -1)
    torch.testing.assert_close(ops.silu_and_mul(x, impl="cpu"), ops.silu_and_mul(x, impl="torch"),
                               rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (6, 4, 2, 128), (2, 2, 1, 96)])
def test_rotary_matches_torch_on_qkv_views(tokens, heads, kv_heads, head_dim):
    qkv = randn(5, tokens, (heads + 2 * kv_heads) * head_dim)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    before = qkv.clone()
    cache = RotaryEmbedding(head_dim, 64, 10000.0).cos_sin_cache
    positions = torch.randint(64, (tokens,), generator=torch.Generator().manual_seed(6))
    got = ops.rotary_embedding(positions, q, k, cache, impl="cpu")
    torch.testing.assert_close(got, ops.rotary_embedding(positions, q, k, cache, impl="torch"), **CLOSE)
    assert torch.equal(qkv, before), "q and k must not be rotated in place"


def paged_batch(shapes: list[tuple[int, int]], block_size: int, heads: int, kv_heads: int, head_dim: int, seed: int):
    """Sequences (cached tokens, new tokens) on shuffled blocks of a random cache."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // block_size) for c, n in shapes]
    perm = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    seqs = []
    for (cached, new), n in zip(shapes, needed):
        seqs.append((cached, new, perm[:n]))
        perm = perm[n:]
    md = build_metadata(seqs, block_size)
    cache_shape = (sum(needed) + 2, block_size, kv_heads, head_dim)
    cache = (torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen))
    t = md.num_tokens
    return md, torch.randn(t, heads, head_dim, generator=gen), torch.randn(t, kv_heads, head_dim, generator=gen), \
        torch.randn(t, kv_heads, head_dim, generator=gen), cache


@pytest.mark.parametrize("shapes", [[(37, 1)], [(37, 1), (0, 1), (70, 1), (15, 1)], [(50, 23), (37, 1), (0, 9)]],
                         ids=["one decode", "decodes", "prompt chunks and decodes"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_backend_matches_torch_backend(shapes, heads, kv_heads, head_dim, block_size):
    md, q, k, v, cache = paged_batch(shapes, block_size, heads, kv_heads, head_dim, seed=len(shapes) + heads)
    md.slot_mapping[0] = -1  # a token whose KV is already cached is not written
    caches = [tuple(c.clone() for c in cache) for _ in range(2)]
    got = get_attn_backend("cpu").forward(q, k, v, caches[0], md, head_dim**-0.5)
    md.backend_plan = None
    want = get_attn_backend("torch").forward(q, k, v, caches[1], md, head_dim**-0.5)
    torch.testing.assert_close(got, want, **CLOSE)
    for a, b in zip(*caches):
        assert torch.equal(a, b)
    assert torch.equal(caches[0][0], cache[0]) == (md.num_tokens == 1)  # only the -1 row: nothing written


@pytest.mark.parametrize("window", [1, 20, 64])
@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_sliding_window_and_soft_cap_match_torch_backend(window, soft_cap):
    """The blocks before each window hold NaN: the kernel must not read them."""
    shapes = [(37, 1), (70, 1), (50, 23), (0, 41), (100, 3)]
    md, q, k, v, cache = paged_batch(shapes, 16, 9, 3, 64, seed=window)
    cache = poison_blocks_before_windows(md, shapes, window, 16, cache)
    q = q * 3
    got = get_attn_backend("cpu").forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125, window, soft_cap)
    md.backend_plan = None
    want = get_attn_backend("torch").forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125, window, soft_cap)
    torch.testing.assert_close(got, want, **CLOSE)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("sink_scale", [1.0, 30.0])
def test_sinks_match_torch_backend(window, sink_scale):
    """Each head's sink logit joins its softmax, whether it sits below the scores or far above them."""
    shapes = [(37, 1), (70, 1), (50, 23), (0, 41)]
    md, q, k, v, cache = paged_batch(shapes, 16, 9, 3, 64, seed=int(sink_scale))
    if window is not None:
        cache = poison_blocks_before_windows(md, shapes, window, 16, cache)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(1)) * sink_scale
    got = get_attn_backend("cpu").forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125, window, None, sinks)
    md.backend_plan = None
    want = get_attn_backend("torch").forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125, window, None,
                                             sinks)
    torch.testing.assert_close(got, want, **CLOSE)
    md.backend_plan = None
    without = get_attn_backend("torch").forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125, window)
    assert not torch.allclose(got, without, atol=1e-3)


def test_a_querys_result_does_not_depend_on_its_batch():
    """Bit for bit: a decode alone, and the same query as the last of a prompt chunk in a mixed batch."""
    md, q, k, v, cache = paged_batch([(20, 5), (7, 1)], 16, 9, 3, 64, seed=8)
    backend = get_attn_backend("cpu")
    batch = backend.forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125)
    # Sequence 0's last query alone: its context is the cache plus the 4 keys written before it.
    alone_cache = tuple(c.clone() for c in cache)
    backend.forward(q[:4], k[:4], v[:4], alone_cache, build_metadata([(20, 4, md.block_table[0].tolist())], 16), 0.125)
    alone = backend.forward(q[4:5], k[4:5], v[4:5], alone_cache,
                            build_metadata([(24, 1, md.block_table[0].tolist())], 16), 0.125)
    assert torch.equal(alone[0], batch[4])


def test_decode_attention_over_a_long_context_matches_torch():
    md, q, k, v, cache = paged_batch([(1000, 1), (3, 1)], 16, 9, 3, 64, seed=7)
    got = get_attn_backend("cpu").forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125)
    md.backend_plan = None
    want = get_attn_backend("torch").forward(q, k, v, tuple(c.clone() for c in cache), md, 0.125)
    torch.testing.assert_close(got, want, **CLOSE)
    assert np.isfinite(got.numpy()).all()
