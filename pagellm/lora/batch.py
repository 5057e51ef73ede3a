"""One step's map of rows to adapter slots, shared by every adapted layer of the model.

The worker sets it before each forward (`LoRABatch.prepare`); each adapted layer's output then gains
its rows' adapters (`LoRABatch.add`). On the CPU the rows of each slot are gathered and multiplied
with torch; on a GPU the Triton kernels of `pagellm.ops.triton.lora` run over tiles of rows that
share a slot, planned on the host once per step. The tile buffers are persistent and their launch
grid depends only on the padded row count, so a CUDA graph captured over them replays any step of
its size.
"""
from __future__ import annotations

import numpy as np
import torch

from pagellm.ops.lora import max_tiles, plan_tiles


class LoRABatch:
    """Which adapter slot each row of the step's flat batch uses (-1: the base model)."""

    def __init__(self, num_slots: int, max_rows: int, device: torch.device, use_kernels: bool | None = None) -> None:
        """`use_kernels`: apply the adapters with the Triton kernels (None: on CUDA devices)."""
        self.num_slots = num_slots
        self.device = device
        self.active = False
        """Whether the step's rows use any adapter (layers add nothing otherwise)."""
        self.groups: list[tuple[int, torch.Tensor | slice]] = []
        """Torch path (no Triton kernels): (slot, the rows that use it)."""
        self.token_slots: torch.Tensor | None = None
        """Torch path: [rows] int32, each row's slot (the fused CPU decoder layer reads it)."""
        self._kernels = None
        if use_kernels if use_kernels is not None else device.type == "cuda":
            from pagellm.ops.triton import lora as lora_kernels

            self._kernels = lora_kernels
            tiles = max_tiles(max_rows, num_slots, lora_kernels.BLOCK_M)
            self._device_plan = torch.zeros(max_rows + 3 * tiles, dtype=torch.int32, device=device)
            self._max_rows = max_rows
            self._tiles = None

    def prepare(self, token_slots: np.ndarray, padded_rows: int | None = None) -> None:
        """Set the slots of the step's rows; `padded_rows` (>= len(token_slots)): the rows the forward
        really runs (a CUDA graph's padded batch, whose extra rows use no adapter). On a GPU a padded
        step always plans (the graph replays its kernels); else a step without adapters plans nothing."""
        uses = bool(len(token_slots)) and int(token_slots.max()) >= 0
        if self._kernels is None:
            self.active = uses
            self.groups = _groups(token_slots, self.device) if uses else []
            self.token_slots = torch.from_numpy(token_slots.astype(np.int32)) if uses else None
            return
        self.active = uses or padded_rows is not None
        if not self.active:
            return
        rows = padded_rows or len(token_slots)
        slots = token_slots if rows == len(token_slots) else np.concatenate(
            [token_slots, np.full(rows - len(token_slots), -1, dtype=token_slots.dtype)])
        plan = plan_tiles(slots, self._kernels.BLOCK_M, max_tiles(rows, self.num_slots, self._kernels.BLOCK_M))
        # Fixed offsets in the device buffer (rows first, then the tile arrays), so that a graph
        # captured over these views reads each replay's plan.
        m, t = self._max_rows, len(plan.tile_slot)
        size = m + 3 * t
        # Pinned, from torch's caching host allocator (as `worker.batch.upload`): the copy queues
        # behind the step in flight, and the buffer is not reused before the copy has run.
        staging = torch.empty(size, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        host = staging.numpy()
        host[:len(plan.sorted_rows)] = plan.sorted_rows
        for i, part in enumerate((plan.tile_slot, plan.tile_start, plan.tile_end)):
            host[m + i * t:m + (i + 1) * t] = part
        self._device_plan[:size].copy_(staging, non_blocking=True)
        tiles = self._device_plan[m:size].view(3, t)
        self._tiles = self._kernels.LoRATilesDevice(self._device_plan[:m], tiles[0], tiles[1], tiles[2],
                                                    self._kernels.BLOCK_M)

    @property
    def uses_kernels(self) -> bool:
        return self._kernels is not None

    def add_with_kernels(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         part_offsets: tuple[int, ...]) -> None:
        """y [rows, out] += each row's adapter applied to x [rows, in], by the Triton kernels
        (`a`, `b`: a layer's slots, in `pagellm.ops.lora`'s layout)."""
        # Only the tiles' rows of h are written and read: no need to clear it.
        splits = self._kernels.shrink_splits(x.shape[1], self._tiles.num_tiles)
        h = torch.empty((splits, x.shape[0], a.shape[1]), dtype=torch.float32, device=x.device)
        self._kernels.lora_shrink(x, a, self._tiles, h)
        self._kernels.lora_expand(y, h, b, part_offsets, self._tiles)


def _groups(token_slots: np.ndarray, device: torch.device) -> list[tuple[int, torch.Tensor | slice]]:
    """(slot, rows) for each slot in use: a slice when its rows are contiguous (a single request,
    or one adapter for the whole step), else an index tensor."""
    groups = []
    for slot in np.unique(token_slots).tolist():
        if slot < 0:
            continue
        rows = np.flatnonzero(token_slots == slot)
        if rows[-1] - rows[0] + 1 == len(rows):
            groups.append((slot, slice(int(rows[0]), int(rows[-1]) + 1)))
        else:
            groups.append((slot, torch.from_numpy(rows).to(device)))
    return groups
