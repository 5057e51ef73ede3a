"""The `triton` attention backend: the GPU default, tested against the `torch` backend."""
from __future__ import annotations

import functools

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from pagellm.layers.rotary import RotaryEmbedding
from pagellm.ops.triton.attention import paged_attention, rotary_write_kv, write_kv

MAX_SPLITS = 16
"""Most ranges a decode's context is split into (flash-decoding)."""
TARGET_PROGRAMS = 264
"""Programs a decode step should launch to fill the GPU: two per multiprocessor of an H100/H200."""


def decode_splits(num_seqs: int, num_kv_heads: int) -> int:
    """How many ranges each decode's context is split into, so that (sequence, KV head, range)
    programs fill the GPU. It depends on the batch shape only, not on context lengths, so a
    CUDA graph captured for a batch size stays valid whatever the lengths at replay."""
    splits = 1
    while splits < MAX_SPLITS and num_seqs * num_kv_heads * splits < TARGET_PROGRAMS:
        splits *= 2
    return splits


class TritonAttentionBackend(AttentionBackend):
    """KV write (with the rotary embedding, where the layer hands it over) and paged attention as
    Triton kernels, one launch each per layer (plus a merge launch for split decodes); no host
    sync, so decode steps can be captured in CUDA graphs."""

    name = "triton"

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
        if kv_cache is None:
            out = torch.empty_like(query)
            _attend_in_batch(out, query, key, value, metadata, scale, sliding_window, logits_soft_cap, sinks)
            return out
        write_kv(key, value, *kv_cache, metadata.slot_mapping)
        return _attend_cached(query, kv_cache, metadata, scale, sliding_window, logits_soft_cap, sinks)

    def forward_rotary(
        self,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
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
        # The rotation runs in Triton with the write, as the write does whatever `ops.use_impl` says.
        if kv_cache is None or not _fusable(type(rotary)):
            return super().forward_rotary(rotary, positions, query, key, value, kv_cache, metadata, scale,
                                          sliding_window, logits_soft_cap, sinks)
        query = rotary_write_kv(positions, query, key, value, rotary.cos_sin_cache, *kv_cache, metadata.slot_mapping)
        return _attend_cached(query, kv_cache, metadata, scale, sliding_window, logits_soft_cap, sinks)


@functools.cache
def _fusable(rotary_type: type) -> bool:
    """Whether a rotary module rotates as `RotaryEmbedding` does (rotate-half by its
    `cos_sin_cache`), which is the rotation the fused kernel applies."""
    return rotary_type.forward is RotaryEmbedding.forward


def _attend_cached(query: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata, scale: float,
                   sliding_window: int | None, logits_soft_cap: float | None,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    """Paged attention of query over the cache, which holds this step's keys and values."""
    out = torch.empty_like(query)
    k_cache, v_cache = kv_cache
    # Splitting pays on a GPU with idle multiprocessors; Triton's CPU interpreter runs programs
    # one by one, so there it only multiplies the work.
    split = metadata.max_query_len == 1 and query.is_cuda
    splits = decode_splits(metadata.num_seqs, k_cache.shape[2]) if split else 1
    paged_attention(out, query, k_cache, v_cache, metadata.block_table, metadata.seq_lens,
                    metadata.query_start_loc, metadata.max_query_len, scale, splits, sliding_window, logits_soft_cap,
                    sinks)
    return out


def _attend_in_batch(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     metadata: AttentionMetadata, scale: float, sliding_window: int | None,
                     logits_soft_cap: float | None, sinks: torch.Tensor | None) -> None:
    """Fresh prompts with no cache yet (the memory-profiling pass): this step's key/value rows
    serve as a cache of one-token blocks, and each sequence's block table lists its own rows."""
    qsl = metadata.query_start_loc
    rows = qsl[:-1, None] + torch.arange(metadata.max_query_len, device=qsl.device, dtype=qsl.dtype)
    block_table = rows.clamp_(max=max(query.shape[0] - 1, 0))
    paged_attention(out, query, key.unsqueeze(1), value.unsqueeze(1), block_table, metadata.seq_lens, qsl,
                    metadata.max_query_len, scale, 1, sliding_window, logits_soft_cap, sinks)
