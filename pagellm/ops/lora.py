"""Batched LoRA products, many adapters in one batch: each token's row of `y` gains
(x A_s^T) B_s^T for the adapter in its slot s (slot -1: the base model, nothing added).

The layout every implementation shares (`pagellm.lora.layers` holds the buffers):
- `a` [slots, parts x rank, in_features]: the A matrices of each slot, the parts of a fused layer
  (q/k/v, gate/up) stacked, each `rank` rows (an adapter of a lower rank is zero-padded);
- `b` [slots, out_features, rank]: the B matrices, the scaling (alpha / r) folded in, each part's
  rows at its output offset (`part_offsets`, parts + 1 increasing ints from 0 to out_features).
So the shrink gives h [tokens, parts x rank] and part p of the output reads h's p-th `rank` columns.

The Triton kernels (`pagellm.ops.triton.lora`) work on tiles of rows that share a slot, planned on
the host by `plan_tiles`; these torch functions are the oracle they are tested against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class TilePlan:
    """Rows grouped by slot into tiles of at most `block_m` rows (host arrays, int32)."""

    sorted_rows: np.ndarray
    """[rows with an adapter] the rows of the batch, sorted by slot (stable)."""
    tile_slot: np.ndarray
    """[tiles] each tile's slot; -1 for a padding tile, which does nothing."""
    tile_start: np.ndarray
    """[tiles] each tile's first index into sorted_rows."""
    tile_end: np.ndarray
    """[tiles] one past each tile's last index into sorted_rows."""


def plan_tiles(token_slots: np.ndarray, block_m: int, num_tiles: int | None = None) -> TilePlan:
    """Tiles of at most `block_m` rows of one slot each, covering every row whose slot is >= 0.
    `num_tiles`: pad to this many tiles (a fixed launch grid, as a CUDA graph replays); it must be
    at least what the rows need (`max_tiles`)."""
    token_slots = np.asarray(token_slots)
    rows = np.flatnonzero(token_slots >= 0)
    order = np.argsort(token_slots[rows], kind="stable")
    sorted_rows = rows[order].astype(np.int32)
    slots, counts = np.unique(token_slots[sorted_rows], return_counts=True)
    per_slot = -(-counts // block_m)
    tile_slot = np.repeat(slots, per_slot).astype(np.int32)
    seg_start = np.repeat(np.cumsum(counts) - counts, per_slot)
    seg_end = np.repeat(np.cumsum(counts), per_slot)
    first_tile = np.repeat(np.cumsum(per_slot) - per_slot, per_slot)
    tile_start = (seg_start + (np.arange(len(tile_slot)) - first_tile) * block_m).astype(np.int32)
    tile_end = np.minimum(tile_start + block_m, seg_end).astype(np.int32)
    if num_tiles is not None:
        if num_tiles < len(tile_slot):
            raise ValueError(f"the rows need {len(tile_slot)} tiles, more than the {num_tiles} planned for")
        pad = num_tiles - len(tile_slot)
        tile_slot = np.concatenate([tile_slot, np.full(pad, -1, dtype=np.int32)])
        tile_start = np.concatenate([tile_start, np.zeros(pad, dtype=np.int32)])
        tile_end = np.concatenate([tile_end, np.zeros(pad, dtype=np.int32)])
    return TilePlan(sorted_rows, tile_slot, tile_start, tile_end)


def max_tiles(num_rows: int, num_slots: int, block_m: int) -> int:
    """The most tiles `plan_tiles` makes for `num_rows` rows over at most `num_slots` slots."""
    return -(-num_rows // block_m) + min(num_slots, num_rows)


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """h [T, parts x rank] = x [T, K] times each row's slot's A^T, in float32; 0 for slot -1."""
    safe = token_slots.clamp(min=0).long()
    h = torch.einsum("tk,trk->tr", x.float(), a[safe].float())
    return h * (token_slots >= 0).unsqueeze(1)


def lora_expand_ref(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, part_offsets: tuple[int, ...],
                    token_slots: torch.Tensor) -> None:
    """y [T, N] += part p of h times each row's slot's B rows of part p, for rows of slot >= 0."""
    rank = b.shape[2]
    safe = token_slots.clamp(min=0).long()
    keep = (token_slots >= 0).unsqueeze(1)
    for p in range(len(part_offsets) - 1):
        lo, hi = part_offsets[p], part_offsets[p + 1]
        delta = torch.einsum("tr,tnr->tn", h[:, p * rank:(p + 1) * rank].float(), b[safe, lo:hi].float())
        y[:, lo:hi] += (delta * keep).to(y.dtype)
