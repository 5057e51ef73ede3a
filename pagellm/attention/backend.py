"""The attention backend interface: one flat batch, a paged KV cache, several implementations."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from pagellm.layers.rotary import RotaryEmbedding


@dataclass(slots=True)
class AttentionMetadata:
    """Where each sequence's queries sit in the flat batch and where its KV lives in the cache.

    A batch holds `num_seqs` sequences; sequence i contributes the query tokens
    `query_start_loc[i]:query_start_loc[i+1]` of the flat batch, which are the *last* tokens of
    its context of `seq_lens[i]` tokens (earlier ones are already in the cache).
    """

    num_tokens: int
    """Number of real tokens in the flat batch (rows past it are padding)."""
    query_start_loc: torch.Tensor
    """[num_seqs + 1] int32 on the device: prefix sums of query lengths."""
    seq_lens: torch.Tensor
    """[num_seqs] int32 on the device: context length including this step's tokens."""
    block_table: torch.Tensor
    """[num_seqs, max_num_blocks_per_seq] int32 on the device: physical block ids, padded."""
    slot_mapping: torch.Tensor
    """[num_tokens] int64 on the device: cache slot (block_id * block_size + offset) per token; -1 = don't write."""
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: np.ndarray
    """Host copy of `query_start_loc`, so backends can plan without a device sync."""
    seq_lens_cpu: np.ndarray
    """Host copy of `seq_lens`."""
    backend_plan: Any = None
    """What a backend derives from the fields above, built by the first layer of the step and
    reused by the others (the torch backend's gather indices and masks)."""
    kv_groups: "tuple[AttentionMetadata, ...]" = ()
    """The metadata of KV cache groups 1, 2, ... (layers that keep their own blocks: those of one
    sliding window), alike but for their `block_table`, `slot_mapping` and plan; this one is group
    0's. Empty: the model has one group."""

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata the layers of KV cache group `group` read."""
        return self if group == 0 else self.kv_groups[group - 1]


KVCache = tuple[torch.Tensor, torch.Tensor]
"""(key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""


class AttentionBackend(ABC):
    """Computes attention for one layer of a flat batch over a paged KV cache."""

    name: str
    fused_cpu_layer: ClassVar[bool] = False
    """The fused C decoder layer (`pagellm.models.cpu_layer`) computes this backend's attention bit
    for bit, so the CPU worker may run that layer in place of the backend (the `cpu` backend's)."""

    @abstractmethod
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
        """Write this step's K/V into the cache, then attend.

        query [num_tokens, num_heads, head_dim]; key/value [num_tokens, num_kv_heads, head_dim].
        Returns [num_tokens, num_heads, head_dim]. With `kv_cache=None` (the memory-profiling
        pass before the cache exists) every sequence must be a prompt starting at position 0, and
        attention is causal within each sequence.

        `sliding_window` w: the query at position p sees the keys at positions p - w < j <= p
        (Hugging Face's convention: w keys, itself included); the cache blocks wholly before the
        step's first query's window may have been given to other requests and must not be read.
        `logits_soft_cap` c: each score s (after `scale`) becomes c * tanh(s / c) before the softmax.
        `sinks` [num_heads] (GPT-OSS's attention sinks): head h's softmax has one more logit, sinks[h],
        which takes its share of the weights but has no value: the weight of key j is
        exp(s_j) / (exp(sinks[h]) + sum_k exp(s_k)), so a query's weights may sum to less than 1.
        """

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
        """`forward` of query and key rotated by `rotary` at `positions` [num_tokens] first; a
        backend may fuse the rotation with its KV write (the Triton one does)."""
        query, key = rotary(positions, query, key)
        return self.forward(query, key, value, kv_cache, metadata, scale, sliding_window, logits_soft_cap, sinks)
