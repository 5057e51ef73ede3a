"""Pure-PyTorch paged attention: runs anywhere and is the oracle the GPU kernels are tested against.

Sequences are attended in at most two batched groups: decode rows (exactly one query each, so no
padding) and prefill/chunk rows (queries padded to the longest in the group). For each group the
keys are gathered from the paged cache through the block table into [B, S, num_kv_heads, D] and one
additive mask encodes both causality and each sequence's length. All planning uses the host copies
in the metadata, so the only device sync is the -1 filter of the slot mapping.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, KVCache


class TorchAttentionBackend(AttentionBackend):
    """Attention with `torch.nn.functional.scaled_dot_product_attention` over gathered KV blocks.

    Cache slots past a sequence's length are masked but still read, so the cache must not hold
    NaN/inf there: allocate it with `torch.zeros`, not `torch.empty`.
    """

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache | None,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        query_start_loc = metadata.query_start_loc_cpu
        q_lens = np.diff(query_start_loc)
        # Rows past num_tokens are batch padding: they stay zero.
        out = torch.zeros_like(query)
        if kv_cache is None:
            seqs = np.flatnonzero(q_lens > 0)
            if len(seqs):
                rows, valid = _padded_rows(query_start_loc, seqs)
                # A prompt from position 0: its keys are its own rows of this step's key/value.
                keys, values = _gather_rows(key, rows), _gather_rows(value, rows)
                _attend(out, query, keys, values, rows, valid, np.zeros_like(seqs), q_lens[seqs], scale)
            return out

        num_tokens = metadata.num_tokens
        _write_kv(key[:num_tokens], value[:num_tokens], kv_cache, metadata.slot_mapping)
        for seqs in (np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1)):
            for bucket in _length_buckets(seqs, metadata.seq_lens_cpu[seqs]):
                self._attend_paged(out, query, kv_cache, metadata, bucket, scale)
        return out

    @staticmethod
    def _attend_paged(
        out: torch.Tensor,
        query: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        seqs: np.ndarray,
        scale: float,
    ) -> None:
        """Attend sequences `seqs` (indices into the batch) against their cached context."""
        k_cache, v_cache = kv_cache
        rows, valid = _padded_rows(metadata.query_start_loc_cpu, seqs)
        seq_lens = metadata.seq_lens_cpu[seqs].astype(np.int64)
        num_blocks = -(-int(seq_lens.max()) // k_cache.shape[1])
        blocks = metadata.block_table[torch.from_numpy(seqs).to(query.device), :num_blocks].flatten()
        # index_select copies whole blocks; advanced indexing is several times slower on CPU.
        gathered_shape = (len(seqs), num_blocks * k_cache.shape[1], *k_cache.shape[2:])
        keys = k_cache.index_select(0, blocks).view(gathered_shape)  # [B, nb * block_size, Hkv, D]
        values = v_cache.index_select(0, blocks).view(gathered_shape)
        _attend(out, query, keys, values, rows, valid, seq_lens - valid.sum(1), seq_lens, scale)


def _write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store each token's K/V at its slot; slots < 0 are not written."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    for cache, new in zip(kv_cache, (key, value)):
        # view (not reshape): a copy would silently drop the writes.
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new[keep])


def _length_buckets(seqs: np.ndarray, seq_lens: np.ndarray, max_waste: float = 0.25) -> list[np.ndarray]:
    """Split `seqs` into groups of similar context length, so that padding every member of a
    group to its longest wastes at most `max_waste` of the real work (gather and attention cost
    grow with the padded length)."""
    order = np.argsort(-seq_lens, kind="stable")
    buckets, start, total = [], 0, 0
    for i, idx in enumerate(order):
        longest = seq_lens[order[start]]
        total += seq_lens[idx]
        if (i + 1 - start) * longest > (1 + max_waste) * total:
            buckets.append(seqs[order[start:i]])
            start, total = i, seq_lens[idx]
    if len(order):
        buckets.append(seqs[order[start:]])
    return buckets


def _padded_rows(query_start_loc: np.ndarray, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat-batch rows of each sequence's queries padded to the longest: (rows, valid), both [B, L].

    Padding repeats the sequence's last row, so gathers stay in bounds.
    """
    starts = query_start_loc[seqs].astype(np.int64)
    lens = query_start_loc[seqs + 1].astype(np.int64) - starts
    offsets = np.arange(lens.max())
    valid = offsets[None, :] < lens[:, None]
    rows = starts[:, None] + np.minimum(offsets[None, :], lens[:, None] - 1)
    return rows, valid


def _gather_rows(x: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """x[rows] for x [T, ...] and rows [B, L] -> [B, L, ...]."""
    return x.index_select(0, torch.from_numpy(rows.ravel()).to(x.device)).view(*rows.shape, *x.shape[1:])


def _attend(
    out: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    rows: np.ndarray,
    valid: np.ndarray,
    first_pos: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
) -> None:
    """Causal attention of a padded group, written into `out` at `rows[valid]`.

    query/out [T, H, D] flat batch; keys/values [B, S, Hkv, D] with S >= max(seq_lens);
    rows/valid [B, L]; first_pos [B] position of each sequence's first query; seq_lens [B].
    """
    device = query.device
    batch, q_len = rows.shape
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    # Query heads sharing a KV head (heads kv*G .. kv*G+G-1) are folded into the query axis,
    # so each KV head is attended once and K/V are never repeated.
    q = _gather_rows(query, rows).view(batch, q_len, num_kv_heads, group, head_dim).transpose(1, 2)
    q = q.reshape(batch, num_kv_heads, q_len * group, head_dim)
    # Query at position p sees keys 0..p; padded queries are clamped to the last real key so no
    # row is fully masked (SDPA would return NaN there).
    last_key = np.minimum(first_pos[:, None] + np.arange(q_len), seq_lens[:, None] - 1)  # [B, L]
    visible = torch.arange(keys.shape[1], device=device) <= torch.from_numpy(last_key).to(device).unsqueeze(-1)
    # An additive float mask: SDPA on CPU runs about twice as fast with it as with a boolean one.
    mask = torch.zeros(visible.shape, dtype=query.dtype, device=device).masked_fill_(~visible, float("-inf"))
    mask = mask[:, None, :, None, :].expand(-1, -1, -1, group, -1).reshape(batch, 1, q_len * group, -1)
    o = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale)
    o = o.view(batch, num_kv_heads, q_len, group, head_dim).transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    flat_valid = np.flatnonzero(valid.ravel())
    dst_rows = torch.from_numpy(rows.ravel()[flat_valid]).to(device)
    out.index_copy_(0, dst_rows, o.index_select(0, torch.from_numpy(flat_valid).to(device)))
