"""The torch backend with decode-only steps in C: one call per layer writes the step's keys and
values and attends each sequence's single query over its paged context (float32, CPU)."""
from __future__ import annotations

import torch

from pagellm.attention.backend import AttentionMetadata, KVCache
from pagellm.attention.torch_backend import TorchAttentionBackend
from pagellm.ops import cpu_ops


class CPUAttentionBackend(TorchAttentionBackend):
    """Steps with prompts (several queries per sequence) and the pre-cache profiling pass run the
    PyTorch path; its tests are the reference for the C one."""

    name = "cpu"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache | None,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_seqs = metadata.num_seqs
        if (kv_cache is None or query.dtype != torch.float32 or metadata.max_query_len != 1
                or metadata.num_tokens != num_seqs):
            return super().forward(query, key, value, kv_cache, metadata, scale)
        k_cache, v_cache = kv_cache
        cpu_ops.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, num_seqs)
        out = cpu_ops.paged_decode_attention(query[:num_seqs], k_cache, v_cache, metadata.block_table,
                                             metadata.seq_lens, scale)
        if query.shape[0] > num_seqs:  # batch padding rows stay zero
            out = torch.cat((out, out.new_zeros(query.shape[0] - num_seqs, *out.shape[1:])))
        return out
