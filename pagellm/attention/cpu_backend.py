"""Attention on the CPU in C (float32): every query of the step, prompt chunks and decodes alike,
attended alone over its sequence's paged context, so a token's result never depends on the batch
or on how its prompt was chunked (the torch backend's batched SDPA differs in the last bits)."""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionMetadata, KVCache
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.ops.c import cpu_ops


class CPUAttentionBackend(TorchAttentionBackend):
    """The pre-cache profiling pass, other dtypes and head sizes the kernel does not take run the
    PyTorch path, the reference the C kernel is tested against (a float8 cache is refused at
    start-up: the kernel reads float32 caches)."""

    name = "cpu"
    fused_cpu_layer = True

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
        if kv_cache is None or not cpu_ops.attention_supports(query):
            return super().forward(query, key, value, kv_cache, metadata, scale, sliding_window, logits_soft_cap,
                                   sinks)
        k_cache, v_cache = kv_cache
        num_tokens = metadata.num_tokens
        cpu_ops.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, num_tokens)
        out = cpu_ops.paged_attention(query[:num_tokens], k_cache, v_cache, metadata.block_table,
                                      metadata.query_start_loc, metadata.seq_lens, scale, sliding_window,
                                      logits_soft_cap, sinks)
        if query.shape[0] > num_tokens:  # batch padding rows stay zero
            out = torch.cat((out, out.new_zeros(query.shape[0] - num_tokens, *out.shape[1:])))
        return out
