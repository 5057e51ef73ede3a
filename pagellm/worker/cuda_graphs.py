"""CUDA graphs for decode-only steps: the model's forward captured once per batch size of a ladder.

A decode step of a large model is hundreds of small kernel launches; replaying a captured graph
launches them all at once, so the GPU no longer waits on Python. A graph replays fixed tensors, so
each step's inputs are copied into persistent buffers first; a batch is padded up to the next
captured size with rows that are one-token sequences over block 0 whose KV writes are skipped
(slot -1), so they read valid memory, write nothing, and their outputs are ignored.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from pagellm.attention.backend import AttentionMetadata

logger = logging.getLogger(__name__)


MAX_CAPTURE_SIZE = 512
"""Largest batch captured: beyond it a step's GPU work dwarfs its launches, and every captured size
costs start-up time and memory."""


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_num_seqs (and it), at
    most MAX_CAPTURE_SIZE."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode graphs of `forward(input_ids, positions, metadata) -> hidden`, one per size."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        size = self.sizes[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_table = torch.zeros((size, max_blocks_per_seq), dtype=torch.int32, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self._arange = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, size: int) -> AttentionMetadata:
        """Metadata over the buffers' first `size` rows; host copies describe the padded shape only
        (the kernels take every length from the device tensors)."""
        return AttentionMetadata(
            num_tokens=size, query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size], max_query_len=1,
            max_seq_len=1, query_start_loc_cpu=np.arange(size + 1, dtype=np.int32),
            seq_lens_cpu=np.ones(size, dtype=np.int32))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so that the smaller graphs reuse its memory pool."""
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            md = self._metadata(size)
            args = (self.input_ids[:size], self.positions[:size], md)
            self.forward(*args)  # compiles the kernels and settles the allocator before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(*args)
            pool = graph.pool()
            self._graphs[size] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s", len(self.sizes),
                    self.max_size, time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Replay the smallest graph that holds this decode-only batch; returns its hidden rows."""
        n = md.num_seqs
        size = next(s for s in self.sizes if s >= n)
        width = md.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.query_start_loc[:n + 1].copy_(md.query_start_loc)
        self.seq_lens[:n].copy_(md.seq_lens)
        self.block_table[:n, :width].copy_(md.block_table)
        self.slot_mapping[:n].copy_(md.slot_mapping)
        if size > n:  # padding rows: one token each, seeing one cached slot, writing nothing
            self.query_start_loc[n + 1:size + 1].copy_(self._arange[n + 1:size + 1])
            self.seq_lens[n:size].fill_(1)
            self.slot_mapping[n:size].fill_(-1)
        graph, out = self._graphs[size]
        graph.replay()
        return out[:n]
