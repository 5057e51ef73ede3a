"""A pull's NIXL descriptors in runs: where a request's block ids here and on the producer step together
(a fresh allocator hands out consecutive blocks; a freed request's blocks come back tail first, so
descending), each cache tensor's stretch of blocks is one descriptor instead of one per block.

NIXL's cost is per descriptor (tens of microseconds each on a GPU), so a 256-block prompt over 64
cache tensors is 64 descriptors rather than 16,384. Both lists are built with numpy, one row per
(tensor, run): no Python loop over blocks or tensors.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class BlockRuns:
    """Stretches of a pull that move as one piece: run r copies remote blocks
    `remote_first[r] .. remote_first[r] + lengths[r] - 1` onto the local blocks from `local_first[r]`."""

    local_first: np.ndarray
    remote_first: np.ndarray
    lengths: np.ndarray


def block_runs(local_ids: Sequence[int], remote_ids: Sequence[int]) -> BlockRuns:
    """Split a pull of `remote_ids` into `local_ids` (in order: block i lands on block i) into runs:
    maximal stretches where both ids go up by one, or both go down by one (such a stretch is given
    by its lowest ids: copying it in ascending order is the same block-for-block mapping)."""
    local = np.asarray(local_ids, dtype=np.int64)
    remote = np.asarray(remote_ids, dtype=np.int64)
    if local.shape != remote.shape or local.ndim != 1:
        raise ValueError(f"kv_transfer_params remote_block_ids: {remote.size} blocks to pull into {local.size}")
    if not local.size:
        return BlockRuns(local, remote, local)
    step = np.diff(local)
    joined = (step == np.diff(remote)) & (np.abs(step) == 1)
    split = ~joined
    # A change of direction is a new run (only possible when an id repeats, but then a run must not
    # fold back on itself).
    split[1:] |= joined[1:] & joined[:-1] & (step[1:] != step[:-1])
    starts = np.concatenate(([0], np.flatnonzero(split) + 1))
    lasts = np.append(starts[1:], local.size) - 1
    return BlockRuns(np.minimum(local[starts], local[lasts]), np.minimum(remote[starts], remote[lasts]),
                     lasts - starts + 1)


def run_descriptors(base_addrs: Sequence[int], block_bytes: int, first_blocks: np.ndarray, lengths: np.ndarray,
                    device_id: int) -> np.ndarray:
    """NIXL's (address, length, device) rows of every run of every cache tensor, tensor by tensor:
    the local and the remote list of a pull, built alike, pair up row for row."""
    addrs = np.asarray(base_addrs, dtype=np.int64)
    rows = np.empty((addrs.size * first_blocks.size, 3), dtype=np.int64)
    rows[:, 0] = (addrs[:, None] + first_blocks[None, :] * block_bytes).reshape(-1)
    rows[:, 1] = np.tile(lengths * block_bytes, addrs.size)
    rows[:, 2] = device_id
    return rows
