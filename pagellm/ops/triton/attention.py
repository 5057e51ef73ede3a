"""Triton kernels of the `triton` attention backend: KV write by slot mapping (alone, or with the
rotary embedding of the step's queries and keys), and paged attention.

`paged_attention` serves every kind of step with one kernel: a program owns up to BLOCK_Q query
tokens of one sequence times the query heads of one KV head (GQA heads are folded into the rows
of the tile, so each K/V tile is loaded once for the whole group), and walks that sequence's
context in BLOCK_N-token tiles gathered through the block table, with an online softmax. Prefill
chunks attend to their cached prefix and causally to themselves; a decode is a query of length 1.
When a step has too few (sequence, KV head) pairs to fill the GPU, the context is split into
NUM_SPLITS ranges that separate programs attend (flash-decoding); a second kernel merges their
partial results by their log-sum-exp.

Both kernels take every size as a runtime value or a fixed per-shape constant, and never sync
with the host, so a decode step can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagellm.ops.dispatch import triton_interpreting
from pagellm.ops.triton.rotary import rotate_heads
from pagellm.ops.triton.utils import last_dim_contiguous, num_warps_for, pdl, pdl_release, pdl_start, pdl_wait

_LOG2E = 1.4426950408889634
_LOG2E_JIT = tl.constexpr(_LOG2E)

TUNING = {
    "decode": {"block_n": 64, "k_rows": False, "num_warps": 4, "num_stages": 2},
    "large_decode": {"block_n": 128, "k_rows": False, "num_warps": 4, "num_stages": 2},
    "prefill": {"block_n": 32, "k_rows": False, "num_warps": 4, "num_stages": 2},
    "decode_fp8": {"block_n": 128, "k_rows": False, "num_warps": 4, "num_stages": 2, "f16_dots": True},
}
"""Launch parameters for head_dim 128 by kind of step (short queries, short queries of a large
batch, prefill chunks, short queries over a float8 cache); head_dim 64 always takes 64-key tiles.
`benchmarks/attention_kernel_bench.py` sweeps these on a GPU. On an H200 a bf16 cache reads at
0.95-1.0 of copy bandwidth for 256-512 sequences x 8 KV heads (128-key tiles) and 0.91 for 64 x 8
(64-key tiles). A float8 cache reads at 0.47 with the bf16 decode tiles, but 0.62-0.64 (0.58 at
64 x 8) with its own: 128-key tiles and `f16_dots`, the dots in float16, to which a float8 pair
widens in one instruction (to bfloat16 it takes several), the queries clamped to float16's range.
It stays short of bf16's fraction: with keys loaded as rows (as fast in the sweep), the widened
tiles took 253 registers a thread, two programs an SM (Nsight Compute over
`benchmarks/kernel_probe.py`, `benchmarks/results/ncu_kernel_probe_h200_20261203.txt`)."""
LARGE_DECODE_PROGRAMS = 2048
"""(sequence, KV head) pairs from which a decode batch takes the "large_decode" tiles. It depends on
the batch shape only, so a CUDA graph captured for a batch size stays valid."""


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    positions_ptr, q_ptr, cos_sin_ptr, q_out_ptr,  # ROTATE only
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    stride_qt, stride_qh, stride_cos, NUM_HEADS,  # ROTATE only
    NUM_KV_HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEADS_Q_P: tl.constexpr, HALF: tl.constexpr,
    HALF_P: tl.constexpr, BLOCK_SIZE: tl.constexpr, ROTATE: tl.constexpr,
    PDL: tl.constexpr = False,  # see `pdl`
):
    # One program a token. With ROTATE, its cos/sin row is loaded once for its query heads (to
    # q_out) and its key heads (rotated straight into the cache). The step's positions and slots
    # and the cos/sin table are read before the wait: every kernel of a forward releases before it
    # waits, so such reads may overlap any earlier kernel of it, and what they read must be written
    # before the forward starts (by copies, as `attention_layout` and the decode graphs' inputs are).
    pdl_release(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if ROTATE:
        pos = tl.load(positions_ptr + token).to(tl.int64)
        d = tl.arange(0, HALF_P)
        cos = tl.load(cos_sin_ptr + pos * stride_cos + d, mask=d < HALF, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cos + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    if ROTATE:
        rotate_heads(q_ptr + token * stride_qt, q_out_ptr + token * NUM_HEADS * 2 * HALF, stride_qh, 2 * HALF,
                     NUM_HEADS, cos, sin, HALF, HEADS_Q_P, HALF_P)
    if slot < 0:  # padding, or a token whose KV is already cached
        return
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, 2 * HALF_P)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < 2 * HALF)
    # The cache's type (a float8 cache: rounded to nearest; the layer has divided by its scales).
    if ROTATE:
        rotate_heads(key_ptr + token * stride_kt, k_cache_ptr + dst, stride_kh, stride_ch, NUM_KV_HEADS, cos, sin,
                     HALF, HEADS_P, HALF_P)
    else:
        k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
        tl.store(k_cache_ptr + dst + heads * stride_ch + dims, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(v_cache_ptr + dst + heads * stride_ch + dims, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Store key/value [T, Hkv, D] rows at their cache slots; slots < 0 are skipped.

    The caches' block and slot strides must be the same for K and V (they are allocated alike).
    """
    _write(key, value, k_cache, v_cache, slot_mapping, None)


def rotary_write_kv(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """`rotary_embedding` and `write_kv` in one launch: query [T, H, D] and key [T, Hkv, D] rotated
    by positions [T] (cos_sin_cache [max_position, D]: cos, then sin), the rotated key and value
    [T, Hkv, D] stored at their cache slots (slots < 0 skipped). Returns the rotated query (new,
    contiguous); the key is only stored. Views of a fused qkv are fine (last dims contiguous)."""
    head_dim = query.shape[-1]
    if head_dim % 2 or key.shape[-1] != head_dim or value.shape != key.shape or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"rotary_write_kv needs one even head_dim for query {tuple(query.shape)}, key "
                         f"{tuple(key.shape)}, value {tuple(value.shape)} and cos_sin_cache "
                         f"{tuple(cos_sin_cache.shape)}")
    q = last_dim_contiguous(query)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _write(last_dim_contiguous(key), last_dim_contiguous(value), k_cache, v_cache, slot_mapping,
           (positions, q, last_dim_contiguous(cos_sin_cache), q_out))
    return q_out


def _write(key, value, k_cache, v_cache, slot_mapping, rotate) -> None:
    """One `_write_kv_kernel` launch; `rotate`: (positions, query, cos_sin_cache, query out) or None."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    positions, q, cos_sin, q_out = rotate if rotate is not None else (slot_mapping, key, key, key)  # unused
    half = head_dim // 2
    heads_q_p = triton.next_power_of_2(q.shape[1])
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, positions, q, cos_sin, q_out,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q.stride(0), q.stride(1), cos_sin.stride(0),
        q.shape[1], NUM_KV_HEADS=num_kv_heads, HEADS_P=triton.next_power_of_2(num_kv_heads), HEADS_Q_P=heads_q_p,
        HALF=half, HALF_P=triton.next_power_of_2(half), BLOCK_SIZE=k_cache.shape[1], ROTATE=rotate is not None,
        num_warps=num_warps_for(heads_q_p * triton.next_power_of_2(half)) if rotate is not None else 4,
        **pdl(key.device),
    )


@triton.jit
def _attend_tile(
    q, q_pos, m_i, l_i, acc, start, kv_lo, kv_hi, seq, kv_head, k_cache_ptr, v_cache_ptr, block_table_ptr,
    qk_scale, window, soft_cap_log2,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, K_ROWS: tl.constexpr,
    SLIDING: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    """One BLOCK_N-key tile of the online softmax over keys kv_lo <= k < kv_hi (none other is
    read): returns the updated (max, sum, accumulator)."""
    dims = tl.arange(0, HEAD_DIM)
    k_idx = start + tl.arange(0, BLOCK_N)
    k_ok = (k_idx >= kv_lo) & (k_idx < kv_hi)
    page = tl.load(block_table_ptr + seq * stride_bt + k_idx // BLOCK_SIZE, mask=k_ok, other=0)
    in_page = k_idx % BLOCK_SIZE
    key_rows = page * stride_kb + in_page * stride_ks + kv_head * stride_kh
    # A float8 cache's entries are widened to the queries' type for the dots.
    if K_ROWS:  # keys as stored, [BLOCK_N, HEAD_DIM], transposed for the dot
        k = tl.trans(tl.load(k_cache_ptr + key_rows[:, None] + dims[None, :], mask=k_ok[:, None], other=0.0))
    else:
        k = tl.load(k_cache_ptr + key_rows[None, :] + dims[:, None], mask=k_ok[None, :], other=0.0)
    k = k.to(q.dtype)
    s = tl.dot(q, k) * qk_scale
    if SOFT_CAP:  # s = q.k x scale / cap here: cap x tanh(s), in the log2 domain (soft_cap_log2 = cap x log2 e)
        e = tl.exp(-2.0 * tl.abs(s))
        s = soft_cap_log2 * tl.where(s >= 0, 1.0, -1.0) * (1.0 - e) / (1.0 + e)
    # (log2 domain: exp2 below)
    visible = k_ok[None, :] & (k_idx[None, :] <= q_pos[:, None])
    if SLIDING:
        visible = visible & (k_idx[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen no visible key yet keeps m = -inf; shift it by 0 instead (no NaN).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    v = tl.load(v_cache_ptr + (page * stride_vb + in_page * stride_vs + kv_head * stride_vh)[:, None]
                + dims[None, :], mask=k_ok[:, None], other=0.0).to(q.dtype)  # [BLOCK_N, HEAD_DIM]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


# The block table's width changes with the longest sequence of each step: not specialized on, or
# Triton would compile a variant for widths of 1, multiples of 16 and the rest in the middle of serving.
@triton.jit(do_not_specialize=["stride_bt"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    part_out_ptr, part_ml_ptr, sinks_ptr, qk_scale, window, soft_cap_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    INTERPRET: tl.constexpr, K_ROWS: tl.constexpr, F16_DOTS: tl.constexpr, SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr, SINKS: tl.constexpr,
    PDL: tl.constexpr = False,  # see `pdl`
):
    # The step's layout is read before the wait (see `_write_kv_kernel`); the block table is not:
    # the memory-profiling pass computes it with the kernel before.
    pdl_release(PDL)
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) % NUM_KV_HEADS
    split = tl.program_id(2) // NUM_KV_HEADS

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    pdl_wait(PDL)
    if q_block * BLOCK_Q >= q_len:
        return
    first_pos = seq_len - q_len  # position of the sequence's first query token

    # Row r of the tile: query token r // GROUP_P of this block, query head r % GROUP_P of the group.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (q_idx < q_len) & (rows % GROUP_P < GROUP)
    q_pos = first_pos + q_idx
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    if F16_DOTS:  # the tiles take the queries' type (see TUNING)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)

    # Keys this block can see: up to its last query's position (causal), from its first query's
    # window (blocks before it may hold other requests' keys now), then this split's share.
    kv_end = tl.minimum(seq_len, first_pos + tl.minimum((q_block + 1) * BLOCK_Q, q_len))
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(first_pos + q_block * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS == 1:
        kv_lo = kv_start
        kv_hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = kv_start + split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Triton's CPU interpreter cannot run a `for` over a range with run-time bounds (it needs
    # them as Python ints); the compiled kernel wants the `for`, which it software-pipelines.
    if INTERPRET:
        start = kv_lo
        while start < kv_hi:
            m_i, l_i, acc = _attend_tile(
                q, q_pos, m_i, l_i, acc, start, kv_lo, kv_hi, seq, kv_head, k_cache_ptr, v_cache_ptr,
                block_table_ptr, qk_scale, window, soft_cap_log2, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, stride_bt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, K_ROWS, SLIDING, SOFT_CAP)
            start += BLOCK_N
    else:
        for start in range(kv_lo, kv_hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, q_pos, m_i, l_i, acc, start, kv_lo, kv_hi, seq, kv_head, k_cache_ptr, v_cache_ptr,
                block_table_ptr, qk_scale, window, soft_cap_log2, stride_kb, stride_ks, stride_kh, stride_vb,
                stride_vs, stride_vh, stride_bt, BLOCK_N, BLOCK_SIZE, HEAD_DIM, K_ROWS, SLIDING, SOFT_CAP)

    if SINKS and NUM_SPLITS == 1:  # split decodes add the sink when they merge
        m_i, l_i, acc = _add_sink(sinks_ptr, head, row_ok, m_i, l_i, acc)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    token = q_start + q_idx
    if NUM_SPLITS == 1:
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _add_sink(sinks_ptr, head, row_ok, m_i, l_i, acc):
    """The online softmax's (max, sum, accumulator) of rows of `head`s with each head's sink logit
    (natural log, in float32) taken as one more score without a value: rescaled to the new max
    when the sink is above it, so that a large sink cannot overflow the sum."""
    sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * _LOG2E_JIT
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_ml_ptr, sinks_ptr, stride_ot, stride_oh, stride_pt, stride_ph,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, SINKS: tl.constexpr,
    PDL: tl.constexpr = False,  # see `pdl`
):
    pdl_start(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    part = token * stride_pt + head * stride_ph + splits
    m = tl.load(part_ml_ptr + part * 2)
    l_s = tl.load(part_ml_ptr + part * 2 + 1)
    m_max = tl.max(m, 0)
    # Splits that saw no key have l = 0 and m = -inf: weight 0 (some split always has keys).
    weight = tl.where(l_s > 0, l_s * tl.exp2(m - m_max), 0.0)
    dims = tl.arange(0, HEAD_DIM)
    o = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :])
    o = tl.where(weight[:, None] > 0, o, 0.0)
    total = tl.sum(weight, 0)
    if SINKS:  # the sink's weight relative to m_max, which it may exceed: then all of it scales down
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E_JIT
        m_new = tl.maximum(m_max, sink)
        shrink = tl.exp2(m_max - m_new)
        weight = weight * shrink
        total = total * shrink + tl.exp2(sink - m_new)
    merged = tl.sum(o * weight[:, None], 0) / total
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, merged.to(out_ptr.dtype.element_ty))


DECODE_QUERY_LEN = 16
"""Queries up to this long (decodes, speculative tokens) take the decode tiles."""


def tuning_kind(max_query_len: int, num_seqs: int, num_kv_heads: int, cache_dtype: torch.dtype) -> str:
    """The `TUNING` entry a step takes: from the batch's shape and the cache's type only."""
    if max_query_len > DECODE_QUERY_LEN:
        return "prefill"
    if cache_dtype == torch.float8_e4m3fn:
        return "decode_fp8"
    return "large_decode" if num_seqs * num_kv_heads >= LARGE_DECODE_PROGRAMS else "decode"


def paged_attention(
    out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
    max_query_len: int, scale: float, num_splits: int = 1, sliding_window: int | None = None,
    logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
) -> None:
    """out/query [T, H, D]; caches [num_blocks, block_size, Hkv, D] (or any strided view with the
    same index order); block_table [num_seqs, W]; seq_lens [num_seqs]; query_start_loc
    [num_seqs + 1]. Every row of `out` that belongs to a sequence is written. `sliding_window`,
    `logits_soft_cap` and `sinks` [H] as `AttentionBackend.forward` takes them (None: none).

    num_splits (a power of 2) > 1 splits each sequence's context over that many programs; it only
    makes sense for short queries (decodes), where the grid would otherwise be too small.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_table.shape[0]
    num_kv_heads = k_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    # tl.dot needs at least 16 rows; short queries fill them with more query tokens.
    decode = max_query_len <= DECODE_QUERY_LEN
    block_q = max(1, (16 if decode else 64) // group_p)
    cfg = TUNING[tuning_kind(max_query_len, num_seqs, num_kv_heads, k_cache.dtype)]
    block_n = 64 if head_dim <= 64 else cfg["block_n"]
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads * num_splits)
    if num_splits > 1:
        part_out = query.new_empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32)
        part_ml = query.new_empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32)
    else:
        part_out = part_ml = out  # unused
    sinks_arg = out if sinks is None else sinks  # unused without sinks
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_table, seq_lens, query_start_loc,
        # The scores' scale: into the log2 domain (exp2), or with a soft cap onto tanh's argument.
        part_out, part_ml, sinks_arg, scale * _LOG2E if logits_soft_cap is None else scale / logits_soft_cap,
        sliding_window or 0, (logits_soft_cap or 1.0) * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0),
        num_heads * num_splits, num_splits, 1,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_P=group_p, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim, NUM_SPLITS=num_splits, INTERPRET=triton_interpreting(),
        K_ROWS=cfg["k_rows"], F16_DOTS=cfg.get("f16_dots", False), SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None, SINKS=sinks is not None, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
        **pdl(query.device),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_ml, sinks_arg, out.stride(0), out.stride(1), num_heads * num_splits, num_splits,
            NUM_HEADS=num_heads, NUM_SPLITS=num_splits, HEAD_DIM=head_dim, SINKS=sinks is not None,
            **pdl(query.device),
        )

