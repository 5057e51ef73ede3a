"""CUDA graphs for decode steps: the model's forward captured once per batch size of a ladder, and
per query length: 1, and 1 + k for verification steps of speculative decoding.

A decode step of a large model is hundreds of small kernel launches; replaying a captured graph
launches them all at once, so the GPU no longer waits on Python. A graph replays fixed tensors, so
each step's inputs are copied into persistent buffers first; a batch is padded up to the next
captured size with rows that are one-token sequences over block 0 whose KV writes are skipped
(slot -1), so they read valid memory, write nothing, and their outputs are ignored. A graph of
query length q takes any step whose queries are all at most q long: each is padded at its end to
q rows (slot -1, its sequence length grown to match), which the real rows never attend to.
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
MAX_CAPTURE_TOKENS = 2048
"""Largest step of query length > 1 captured (batch size x query length)."""


def padded_rows(query_start_loc: np.ndarray, q: int) -> np.ndarray:
    """Row of each flat token in a batch whose sequence i owns rows i*q .. i*q+q-1 (its tokens
    first), for queries of at most q tokens."""
    lens = np.diff(query_start_loc)
    starts = np.repeat(query_start_loc[:-1], lens)
    return np.repeat(np.arange(len(lens), dtype=np.int64) * q, lens) + np.arange(int(query_start_loc[-1])) - starts


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_num_seqs (and it), at
    most MAX_CAPTURE_SIZE."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top, 8)) + [top]
    return sorted(set(sizes))


class DecodeGraphs:
    """Captured decode graphs of `forward(input_ids, positions, metadata) -> hidden`, one per size."""

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
                 max_num_seqs: int, max_blocks_per_seq: int, device: torch.device, verify_len: int = 1,
                 before_capture: Callable[[int], None] | None = None, num_kv_groups: int = 1) -> None:
        """`verify_len`: 1 + the drafts of a verification step (speculative decoding), also captured
        for the sizes whose steps stay within MAX_CAPTURE_TOKENS; 1: decode only. `before_capture`:
        called with the padded row count before each graph's forward is captured (what the forward
        reads besides these buffers, set up for that size: LoRA's tile plan). `num_kv_groups`: the
        block tables and slot mappings a step has (one per KV cache group)."""
        self.forward = forward
        self.before_capture = before_capture
        self.sizes = capture_sizes(max_num_seqs)
        self.verify_len = verify_len
        self.verify_sizes = [s for s in self.sizes if s * verify_len <= MAX_CAPTURE_TOKENS] if verify_len > 1 else []
        size = self.sizes[-1]
        tokens = max(size, max(self.verify_sizes, default=0) * verify_len)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.int32, device=device)
        self.block_tables = [torch.zeros((size, max_blocks_per_seq), dtype=torch.int32, device=device)
                             for _ in range(num_kv_groups)]
        self.slot_mappings = [torch.full((tokens,), -1, dtype=torch.int64, device=device) for _ in range(num_kv_groups)]
        self._arange = torch.arange(size + 1, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.num_verify_replays = 0

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def _metadata(self, size: int, q: int = 1) -> AttentionMetadata:
        """Metadata over the buffers' first `size` sequences of `q` rows; host copies describe the
        padded shape only (the kernels take every length from the device tensors)."""
        groups = [AttentionMetadata(
            num_tokens=size * q, query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=table[:size], slot_mapping=slots[:size * q], max_query_len=q,
            max_seq_len=q, query_start_loc_cpu=np.arange(size + 1, dtype=np.int32) * q,
            seq_lens_cpu=np.full(size, q, dtype=np.int32))
            for table, slots in zip(self.block_tables, self.slot_mappings)]
        groups[0].kv_groups = tuple(groups[1:])
        return groups[0]

    def graph(self, size: int, q: int = 1) -> torch.cuda.CUDAGraph:
        """The captured graph of `size` sequences of `q` tokens (benchmarks time its replay)."""
        return self._graphs[size, q][0]

    def padded_rows(self, md: AttentionMetadata) -> int:
        """The rows the graph that takes this step runs (see `fits`)."""
        if md.max_query_len == 1:
            return next(s for s in self.sizes if s >= md.num_seqs)
        return next(s for s in self.verify_sizes if s >= md.num_seqs) * self.verify_len

    def fits(self, md: AttentionMetadata) -> bool:
        """Whether a captured graph takes this step."""
        if md.block_table is not None and md.block_table.shape[1] > self.block_tables[0].shape[1]:
            return False
        if md.max_query_len == 1:
            return md.num_seqs <= self.max_size
        return md.max_query_len <= self.verify_len and md.num_seqs <= max(self.verify_sizes, default=0)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size and query length, largest first so that the smaller graphs reuse
        its memory pool."""
        start = time.perf_counter()
        pool = None
        shapes = sorted([(s * self.verify_len, s, self.verify_len) for s in self.verify_sizes]
                        + [(s, s, 1) for s in self.sizes], reverse=True)
        for _, size, q in shapes:
            self.query_start_loc[:size + 1].copy_(self._arange[:size + 1] * q)
            self.seq_lens[:size].fill_(q)
            md = self._metadata(size, q)
            args = (self.input_ids[:size * q], self.positions[:size * q], md)
            if self.before_capture is not None:
                self.before_capture(size * q)
            self.forward(*args)  # compiles the kernels and settles the allocator before capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(*args)
            pool = graph.pool()
            self._graphs[size, q] = (graph, out)
        self.query_start_loc.copy_(self._arange)
        self.seq_lens.fill_(1)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d)%s in %.1f s", len(self.sizes),
                    self.max_size, f" and {len(self.verify_sizes)} of {self.verify_len}-token verification steps"
                    if self.verify_sizes else "", time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """Replay the smallest graph that holds this batch (see `fits`); returns its hidden rows."""
        if md.max_query_len > 1:
            return self._run_padded(input_ids, positions, md)
        n = md.num_seqs
        size = next(s for s in self.sizes if s >= n)
        width = md.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.query_start_loc[:n + 1].copy_(md.query_start_loc)
        self.seq_lens[:n].copy_(md.seq_lens)
        for g, (table, slots) in enumerate(zip(self.block_tables, self.slot_mappings)):
            group = md.for_group(g)
            table[:n, :width].copy_(group.block_table)
            slots[:n].copy_(group.slot_mapping)
            if size > n:  # padding rows: one token each, seeing one cached slot, writing nothing
                slots[n:size].fill_(-1)
        if size > n:
            self.query_start_loc[n + 1:size + 1].copy_(self._arange[n + 1:size + 1])
            self.seq_lens[n:size].fill_(1)
        graph, out = self._graphs[size, 1]
        graph.replay()
        return out[:n]

    def _run_padded(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        """A step of queries up to `verify_len` long, each padded to it (module docstring)."""
        n, q = md.num_seqs, self.verify_len
        size = next(s for s in self.verify_sizes if s >= n)
        rows = torch.from_numpy(padded_rows(md.query_start_loc_cpu.astype(np.int64), q)).to(
            input_ids.device, non_blocking=True)
        lens = np.diff(md.query_start_loc_cpu)
        grow = torch.from_numpy((q - lens).astype(np.int32)).to(input_ids.device, non_blocking=True)
        tokens = size * q
        self.input_ids[:tokens].zero_()
        self.positions[:tokens].zero_()
        self.input_ids[rows] = input_ids
        self.positions[rows] = positions
        width = md.block_table.shape[1]
        for g, (table, slots) in enumerate(zip(self.block_tables, self.slot_mappings)):
            group = md.for_group(g)
            slots[:tokens].fill_(-1)
            slots[rows] = group.slot_mapping
            table[:n, :width].copy_(group.block_table)
        self.query_start_loc[:size + 1].copy_(self._arange[:size + 1] * q)
        self.seq_lens[:n].copy_(md.seq_lens + grow)
        self.seq_lens[n:size].fill_(q)
        graph, out = self._graphs[size, q]
        graph.replay()
        self.num_verify_replays += 1
        # The next decode graph expects its own layout of these buffers.
        self.query_start_loc.copy_(self._arange)
        return out[rows]
