"""This process's place in the tensor-parallel group.

One small state object, set once per process by `init_tensor_parallel` (the worker calls it
after `torch.distributed.init_process_group`). Until then the process is rank 0 of a group of 1
and every collective is a no-op, so single-device code never touches torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(slots=True)
class TensorParallelState:
    """Rank and size of the tensor-parallel group this process belongs to."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    """The process group collectives run on; None means the default (world) group."""


_state = TensorParallelState()


def init_tensor_parallel(rank: int, world_size: int, group: dist.ProcessGroup | None = None) -> None:
    """Set this process's tensor-parallel rank and group size (and the group to reduce over).

    Call before building the model: layers read the rank and size when they size their shards.
    """
    if world_size < 1:
        raise ValueError(f"tensor-parallel world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank must be in [0, {world_size}), got {rank}")
    _state.rank = rank
    _state.world_size = world_size
    _state.group = group


def get_tp_rank() -> int:
    return _state.rank


def get_tp_world_size() -> int:
    return _state.world_size


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place), returning it."""
    if _state.world_size == 1:
        return x
    dist.all_reduce(x, group=_state.group)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _state.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.world_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.group)
    return torch.cat(parts, dim=dim)
