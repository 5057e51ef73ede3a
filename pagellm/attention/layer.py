"""The attention module a model layer holds: head geometry, a backend, and its KV cache slot."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from pagellm.distributed import get_tp_rank, get_tp_world_size
from pagellm.layers.linear import copy_weight
from pagellm.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    """Multi-head (grouped-query) attention of this rank's heads over a paged KV cache.

    `kv_cache` stays None until the worker allocates the cache and binds this layer's
    (key_cache, value_cache); until then the backend attends within the batch only.

    A float8 cache stores key / k_scale and value / v_scale (per-tensor scales a checkpoint may
    calibrate; 1.0 otherwise): k_scale folds into the softmax scale, v_scale multiplies the output,
    so every backend reads the cache as stored.
    """

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, backend: AttentionBackend,
        sliding_window: int | None = None, logits_soft_cap: float | None = None, sinks: bool = False,
    ) -> None:
        """`sliding_window`: how many keys a query sees, itself included (None: all before it);
        `logits_soft_cap`: scores pass through c * tanh(s / c) (None: as they are); `sinks`: each
        head has a learned sink logit in its softmax (GPT-OSS; `AttentionBackend.forward`), the
        parameter `sinks` [num_heads] of this rank's heads, loaded from the model's whole one."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend = backend
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.sinks: nn.Parameter | None = None
        if sinks:  # device and dtype: the caller's `torch.device(...)` context and default dtype
            self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks
        self.kv_cache: KVCache | None = None
        self.kv_group = 0
        """Its KV cache group (`AttentionMetadata.for_group`), set with the cache it is bound."""
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_metadata: AttentionMetadata,
        rotary: RotaryEmbedding | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query [T, H*D] (or [T, H, D]), key/value [T, Hkv*D] (or [T, Hkv, D]) -> [T, H*D]; with
        `rotary`, query and key are first rotated by their `positions` [T] (by the backend, which
        may fuse it with its KV write)."""
        if rotary is not None and positions is None:
            raise ValueError("a rotary embedding needs the tokens' positions")
        key = key.view(-1, self.num_kv_heads, self.head_dim)
        value = value.view(-1, self.num_kv_heads, self.head_dim)
        scaled = self.kv_cache is not None and self.kv_cache[0].dtype == torch.float8_e4m3fn and (
            self.k_scale != 1.0 or self.v_scale != 1.0)
        if scaled:
            key, value = key / self.k_scale, value / self.v_scale
        query = query.view(-1, self.num_heads, self.head_dim)
        scale = self.scale * self.k_scale if scaled else self.scale
        # A float8 scale folded into `scale` scales the scores the soft cap sees as stored: the same scores.
        md = attn_metadata.for_group(self.kv_group)
        if rotary is None:
            out = self.backend.forward(query, key, value, self.kv_cache, md, scale, self.sliding_window,
                                       self.logits_soft_cap, self.sinks)
        else:  # a rotation commutes with the float8 scales' division above
            out = self.backend.forward_rotary(rotary, positions, query, key, value, self.kv_cache, md, scale,
                                              self.sliding_window, self.logits_soft_cap, self.sinks)
        if scaled:
            out *= self.v_scale
        return out.view(-1, self.num_heads * self.head_dim)

    def _load_sinks(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """This rank's heads' sinks out of the model's [num_attention_heads], query heads split as the
        q projection splits them (rank r holds heads r x H .. (r + 1) x H - 1)."""
        expected = (self.num_heads * get_tp_world_size(),)
        if shard_id is not None or tuple(loaded_weight.shape) != expected:
            raise ValueError(f"attention sinks of shape {tuple(loaded_weight.shape)}: expected {expected}, one "
                             "per attention head")
        copy_weight(param.data, loaded_weight.narrow(0, get_tp_rank() * self.num_heads, self.num_heads))

    def load_kv_scale(self, name: str, value: torch.Tensor) -> None:
        """A checkpoint's float8 KV-cache scale: `name` k_scale, v_scale or kv_scale (both)."""
        if value.numel() != 1:
            raise ValueError(f"a KV-cache {name} of {value.numel()} values: pagellm reads per-tensor scales (one)")
        scale = float(value.reshape(()).float())
        if not scale > 0 or scale == float("inf"):
            raise ValueError(f"a KV-cache {name} of {scale}: it must be positive and finite")
        if name in ("k_scale", "kv_scale"):
            self.k_scale = scale
        if name in ("v_scale", "kv_scale"):
            self.v_scale = scale
