"""Test helpers: build `AttentionMetadata` for a flat batch from a plain description; make the blocks
before sliding windows unreadable."""
from __future__ import annotations

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata


def build_metadata(
    seqs: list[tuple[int, int, list[int]]], block_size: int, device: str | torch.device = "cpu"
) -> AttentionMetadata:
    """One entry per sequence: (tokens already in the cache, new tokens this step, its block ids).

    New tokens are written at the slots their positions map to through the sequence's blocks.
    """
    q_lens = [num_new for _, num_new, _ in seqs]
    seq_lens = np.array([cached + num_new for cached, num_new, _ in seqs], dtype=np.int32)
    query_start_loc = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    width = max(len(blocks) for _, _, blocks in seqs)
    block_table = np.zeros((len(seqs), width), dtype=np.int32)
    slots = []
    for i, (cached, num_new, blocks) in enumerate(seqs):
        if len(blocks) * block_size < cached + num_new:
            raise ValueError(f"sequence {i} needs {cached + num_new} slots but has {len(blocks)} blocks")
        block_table[i, : len(blocks)] = blocks
        positions = np.arange(cached, cached + num_new)
        slots.append(np.asarray(blocks, dtype=np.int64)[positions // block_size] * block_size + positions % block_size)
    slot_mapping = np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)
    return AttentionMetadata(
        num_tokens=int(query_start_loc[-1]),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device),
        block_table=torch.from_numpy(block_table).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=max(q_lens),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def poison_blocks_before_windows(md: AttentionMetadata, shapes: list[tuple[int, int]], window: int, block_size: int,
                                 caches: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """`caches` with one more block, all NaN, at which every block-table entry wholly before a
    sequence's first query's window now points: a backend that reads such a block (freed, maybe
    another request's now) returns NaN."""
    poisoned = tuple(torch.cat([c, torch.full_like(c[:1], float("nan"))]) for c in caches)
    for i, (cached, _) in enumerate(shapes):
        md.block_table[i, :max(cached - window + 1, 0) // block_size] = caches[0].shape[0]
    return poisoned
