"""Pure-PyTorch paged attention: runs anywhere and is the oracle the GPU kernels are tested against.

Sequences are attended in at most two batched groups: decode rows (exactly one query each, so no
padding) and prefill/chunk rows (queries padded to the longest in the group). For each group the
keys are gathered from the paged cache through the block table into [B, S, num_kv_heads, D] and one
additive mask encodes both causality and each sequence's length. The step's first layer plans the
groups (gather indices, masks) from the host copies in the metadata and every other layer reuses
the plan, so a layer costs its gathers and one SDPA call per group; the only device sync is the -1
filter of the slot mapping, once per step. A sliding window's layers gather only the blocks their
queries' windows reach, and plan their own groups (the first such layer of the step).
"""
from __future__ import annotations

from dataclasses import dataclass

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
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        query_start_loc = metadata.query_start_loc_cpu
        q_lens = np.diff(query_start_loc)
        if kv_cache is None:
            # Rows past num_tokens are batch padding: they stay zero.
            out = torch.zeros_like(query)
            seqs = np.flatnonzero(q_lens > 0)
            if len(seqs):
                rows, valid = _padded_rows(query_start_loc, seqs)
                # A prompt from position 0: its keys are its own rows of this step's key/value.
                keys, values = _gather_rows(key, rows), _gather_rows(value, rows)
                _attend(out, query, keys, values, rows, valid, q_lens[seqs], scale, sliding_window, logits_soft_cap,
                        sinks)
            return out

        plan = metadata.backend_plan
        if not isinstance(plan, _Plan):  # the step's first layer plans for all of them
            plan = metadata.backend_plan = _Plan.build(metadata)
        k_cache, v_cache = kv_cache
        for cache, new in ((k_cache, key), (v_cache, value)):
            # view (not reshape): a copy would silently drop the writes.
            rows = new[:metadata.num_tokens] if plan.written is None else new.index_select(0, plan.written)
            _bytes(cache.view(-1, *cache.shape[2:])).index_copy_(0, plan.slots, _bytes(rows.to(cache.dtype)))
        groups = plan.groups(metadata, sliding_window, k_cache.shape[1], query.shape[1] // key.shape[1], query.dtype)
        if len(groups) == 1 and groups[0].covers_batch:
            return groups[0].attend(query, k_cache, v_cache, scale, logits_soft_cap, sinks)
        # Rows past num_tokens are batch padding: they stay zero.
        out = torch.zeros_like(query)
        for group in groups:
            o = group.attend(query, k_cache, v_cache, scale, logits_soft_cap, sinks)
            out.index_copy_(0, group.out_rows, o if group.valid is None else o.index_select(0, group.valid))
        return out


@dataclass(slots=True)
class _Group:
    """Sequences of similar length attended together, their queries padded to the longest:
    the gather indices and mask every layer of the step reuses."""

    blocks: torch.Tensor
    """[B * num_blocks] cache blocks holding the group's context, sequence by sequence."""
    q_rows: torch.Tensor | None
    """[B * L] flat-batch rows of the padded queries (None: the batch's own rows, in order)."""
    mask: torch.Tensor
    """[B, 1, L * G, S] additive causal and length mask, G query heads per KV head."""
    out_rows: torch.Tensor
    """Flat-batch rows of the real (unpadded) queries."""
    valid: torch.Tensor | None
    """Their positions among the B * L padded queries (None: all)."""
    batch: int
    q_len: int

    @property
    def covers_batch(self) -> bool:
        """Whether the group is the whole batch, unpadded, in order (a decode-only step)."""
        return self.q_rows is None and self.valid is None

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
               soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """[B * L, H, D] attention outputs of the group's padded queries."""
        num_heads, head_dim = query.shape[1:]
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        shape = (self.batch, -1, num_kv_heads, head_dim)
        keys = _gather_blocks(k_cache, self.blocks, query.dtype).view(shape).transpose(1, 2)  # [B, Hkv, S, D]
        values = _gather_blocks(v_cache, self.blocks, query.dtype).view(shape).transpose(1, 2)
        q = query if self.q_rows is None else query.index_select(0, self.q_rows)
        # Query heads sharing a KV head (heads kv*G .. kv*G+G-1) are folded into the query axis,
        # so each KV head is attended once and K/V are never repeated.
        q = q.view(self.batch, self.q_len, num_kv_heads, group, head_dim).transpose(1, 2)
        q = q.reshape(self.batch, num_kv_heads, self.q_len * group, head_dim)
        o = _sdpa(q, keys, values, self.mask, scale, soft_cap, sinks)
        return o.view(self.batch, num_kv_heads, self.q_len, group, head_dim).transpose(1, 2).reshape(
            self.batch * self.q_len, num_heads, head_dim)


@dataclass(slots=True)
class _Plan:
    """One step's attention work, planned on the host from the metadata's host copies."""

    slots: torch.Tensor
    """Cache slots this step's keys and values are written to."""
    written: torch.Tensor | None
    """Flat-batch rows written there (None: rows 0 .. num_tokens-1, none skipped)."""
    by_window: dict[int | None, list[_Group]]
    """The groups attended, per sliding window (None: full attention), planned by its first layer."""

    @classmethod
    def build(cls, md: AttentionMetadata) -> "_Plan":
        keep = md.slot_mapping[:md.num_tokens] >= 0  # the step's only device sync
        written = None if bool(keep.all()) else torch.nonzero(keep).flatten()
        slots = md.slot_mapping[:md.num_tokens] if written is None else md.slot_mapping.index_select(0, written)
        return cls(slots, written, {})

    def groups(self, md: AttentionMetadata, window: int | None, block_size: int, group: int,
               dtype: torch.dtype) -> list[_Group]:
        groups = self.by_window.get(window)
        if groups is None:
            q_lens = np.diff(md.query_start_loc_cpu)
            groups = self.by_window[window] = [
                _plan_group(md, bucket, block_size, group, dtype, window)
                for seqs in (np.flatnonzero(q_lens == 1), np.flatnonzero(q_lens > 1))
                for bucket in _length_buckets(seqs, _keys_read(md, seqs, window))]
        return groups


def _keys_read(md: AttentionMetadata, seqs: np.ndarray, window: int | None) -> np.ndarray:
    """How many keys each of `seqs` reads: its context, or within a window what its queries' windows span."""
    seq_lens = md.seq_lens_cpu[seqs].astype(np.int64)
    if window is None:
        return seq_lens
    q_lens = (md.query_start_loc_cpu[seqs + 1] - md.query_start_loc_cpu[seqs]).astype(np.int64)
    return np.minimum(seq_lens, q_lens + window - 1)


def _plan_group(md: AttentionMetadata, seqs: np.ndarray, block_size: int, group: int, dtype: torch.dtype,
                window: int | None) -> _Group:
    device = md.block_table.device
    rows, valid = _padded_rows(md.query_start_loc_cpu, seqs)
    batch, q_len = rows.shape
    seq_lens = md.seq_lens_cpu[seqs].astype(np.int64)
    first_pos = seq_lens - valid.sum(1)
    seq_index = torch.from_numpy(seqs).to(device)
    if window is None:
        first_block = np.zeros_like(seq_lens)
        num_blocks = -(-int(seq_lens.max()) // block_size)
        blocks = md.block_table[seq_index, :num_blocks].flatten()
    else:
        # Only the blocks the queries' windows reach: those before may belong to other requests now.
        first_block = np.maximum(first_pos - window + 1, 0) // block_size
        num_blocks = int((-(-seq_lens // block_size) - first_block).max())
        width = md.block_table.shape[1]
        columns = np.minimum(first_block[:, None] + np.arange(num_blocks), width - 1)
        blocks = md.block_table[seq_index[:, None], torch.from_numpy(columns).to(device)].flatten()
    mask = _causal_mask(first_pos, seq_lens, q_len, num_blocks * block_size, group, dtype, device, window,
                        first_block * block_size)
    flat_rows = rows.ravel()
    flat_valid = np.flatnonzero(valid.ravel())
    return _Group(
        blocks=blocks,
        q_rows=None if np.array_equal(flat_rows, np.arange(md.num_tokens)) else torch.from_numpy(flat_rows).to(device),
        mask=mask,
        out_rows=torch.from_numpy(flat_rows[flat_valid]).to(device),
        valid=None if len(flat_valid) == len(flat_rows) else torch.from_numpy(flat_valid).to(device),
        batch=batch,
        q_len=q_len,
    )


def _causal_mask(first_pos: np.ndarray, seq_lens: np.ndarray, q_len: int, num_keys: int, group: int,
                 dtype: torch.dtype, device: torch.device, window: int | None = None,
                 first_key: np.ndarray | None = None) -> torch.Tensor:
    """[B, 1, L * G, num_keys] additive mask of a padded group, G query heads per KV head folded
    into the query axis; first_pos [B] position of each sequence's first query, seq_lens [B];
    key k of sequence b is at position first_key[b] + k (first_key None: k)."""
    # Query at position p sees keys 0..p (p - window < j <= p in a window); padded queries are
    # clamped to the last real key so no row is fully masked (SDPA would return NaN there).
    last_key = np.minimum(first_pos[:, None] + np.arange(q_len), seq_lens[:, None] - 1)  # [B, L]
    if first_key is not None:
        last_key = last_key - first_key[:, None]
    keys = torch.arange(num_keys, device=device)
    last = torch.from_numpy(last_key).to(device).unsqueeze(-1)
    visible = keys <= last
    if window is not None:
        visible &= keys > last - window
    # An additive float mask: SDPA on CPU runs about twice as fast with it as with a boolean one.
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return mask[:, None, :, None, :].expand(-1, -1, -1, group, -1).reshape(len(seq_lens), 1, q_len * group, -1)


def _sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
          soft_cap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [B, Hkv, M, D] (M = L x G: each query's G heads of a KV head in a row, see
    `_Group.attend`) over keys/values [B, Hkv, S, D] under an additive mask. With `soft_cap`,
    scores capped (c * tanh(s / c)) before the mask; with `sinks` [Hkv x G], each head's sink logit
    joins the softmax as one more column, dropped after it. Both as Hugging Face's eager Gemma 2
    and GPT-OSS compute them (a softmax in float32), which SDPA cannot."""
    if soft_cap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = torch.tanh(scores / soft_cap) * soft_cap
    scores = scores + mask
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype), values)
    batch, num_kv_heads, rows = q.shape[:3]
    group = sinks.numel() // num_kv_heads
    column = sinks.to(scores.dtype).view(1, num_kv_heads, 1, group).expand(batch, -1, rows // group, -1)
    scores = torch.cat((scores, column.reshape(batch, num_kv_heads, rows, 1)), dim=-1)
    return torch.matmul(scores.softmax(dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype), values)


def _length_buckets(seqs: np.ndarray, seq_lens: np.ndarray, max_waste: float = 0.25) -> list[np.ndarray]:
    """Split `seqs` into groups of similar context length (keys read), so that padding every
    member of a group to its longest wastes at most `max_waste` of the real work (gather and
    attention cost grow with the padded length)."""
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
    seq_lens: np.ndarray,
    scale: float,
    window: int | None,
    soft_cap: float | None,
    sinks: torch.Tensor | None,
) -> None:
    """Causal attention of a padded group of prompts from position 0, written into `out` at `rows[valid]`.

    query/out [T, H, D] flat batch; keys/values [B, S, Hkv, D] with S >= max(seq_lens);
    rows/valid [B, L]; seq_lens [B].
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
    mask = _causal_mask(np.zeros_like(seq_lens), seq_lens, q_len, keys.shape[1], group, query.dtype, device, window)
    o = _sdpa(q, keys.transpose(1, 2), values.transpose(1, 2), mask, scale, soft_cap, sinks)
    o = o.view(batch, num_kv_heads, q_len, group, head_dim).transpose(1, 2).reshape(batch * q_len, num_heads, head_dim)
    flat_valid = np.flatnonzero(valid.ravel())
    dst_rows = torch.from_numpy(rows.ravel()[flat_valid]).to(device)
    out.index_copy_(0, dst_rows, o.index_select(0, torch.from_numpy(flat_valid).to(device)))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes: PyTorch's CPU index_copy_ / index_select take no float8."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's `blocks` in `dtype` (a float8 cache's entries widened as stored; the layer applies its scales)."""
    # index_select copies whole blocks; advanced indexing is several times slower on CPU.
    return _bytes(cache).index_select(0, blocks).view(cache.dtype).to(dtype)
