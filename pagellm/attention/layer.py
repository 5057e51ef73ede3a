"""The attention module a model layer holds: head geometry, a backend, and its KV cache slot."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, KVCache


class Attention(nn.Module):
    """Multi-head (grouped-query) attention of this rank's heads over a paged KV cache.

    `kv_cache` stays None until the worker allocates the cache and binds this layer's
    (key_cache, value_cache); until then the backend attends within the batch only.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.kv_cache: KVCache | None = None

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """query [T, H*D] (or [T, H, D]), key/value [T, Hkv*D] (or [T, Hkv, D]) -> [T, H*D]."""
        out = self.backend.forward(
            query.view(-1, self.num_heads, self.head_dim),
            key.view(-1, self.num_kv_heads, self.head_dim),
            value.view(-1, self.num_kv_heads, self.head_dim),
            self.kv_cache,
            attn_metadata,
            self.scale,
        )
        return out.view(-1, self.num_heads * self.head_dim)
