"""This process's place among the ranks of one model replica, and the collectives between them.

Ranks are laid out stage-major: global rank = pipeline stage x tensor-parallel size + tensor-parallel
rank, so the ranks of one stage are neighbours (one node's GPUs) and a stage's TP group is a run of
consecutive ranks. One small state object is set once per process by `init_distributed` (the
worker calls it before building the model). Until then the process is rank 0 of one stage of one
rank and every collective is a no-op, so single-device code never touches torch.distributed.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(slots=True)
class ParallelState:
    """Ranks and groups of the tensor- and pipeline-parallel split this process belongs to."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    """The group TP collectives run on; None means the default (world) group."""
    pp_rank: int = 0
    """This process's pipeline stage."""
    pp_size: int = 1
    expert_parallel: bool = False
    """Mixture-of-experts layers place whole experts on the TP ranks (each holds num_experts / tp_size)
    instead of a slice of every expert (`pagellm.layers.moe`)."""

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """The rank that samples and reports a step's results: TP rank 0 of the last stage."""
        return self.tp_rank == 0 and self.is_last_stage


_state = ParallelState()


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """The contiguous decoder layers of pipeline stage `pp_rank`; earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def init_distributed(rank: int, tensor_parallel_size: int, pipeline_parallel_size: int, backend: str,
                     init_method: str, timeout_s: float, expert_parallel: bool = False) -> None:
    """Join the process group of one replica (all its ranks call this) and make the TP groups.

    `timeout_s` bounds every collective: a rank that waits longer for a dead or hung peer raises
    instead of hanging forever. `expert_parallel`: see `ParallelState.expert_parallel`.
    """
    world_size = tensor_parallel_size * pipeline_parallel_size
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=timedelta(seconds=timeout_s))
    tp_group = None
    if pipeline_parallel_size > 1:
        # new_group is collective: every rank creates every stage's group, in the same order.
        for stage in range(pipeline_parallel_size):
            ranks = list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                tp_group = group
    _state.tp_rank, _state.tp_size, _state.tp_group = rank % tensor_parallel_size, tensor_parallel_size, tp_group
    _state.pp_rank, _state.pp_size = rank // tensor_parallel_size, pipeline_parallel_size
    _state.expert_parallel = expert_parallel


def init_tensor_parallel(rank: int, world_size: int, group: dist.ProcessGroup | None = None,
                         expert_parallel: bool = False) -> None:
    """Set this process's tensor-parallel rank and group size without joining a process group
    (tests that build one rank's shards alone, the planner). Call before building the model."""
    if world_size < 1:
        raise ValueError(f"tensor-parallel world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"tensor-parallel rank must be in [0, {world_size}), got {rank}")
    _state.tp_rank, _state.tp_size, _state.tp_group = rank, world_size, group
    _state.expert_parallel = expert_parallel


def parallel_state() -> ParallelState:
    return _state


def get_tp_rank() -> int:
    return _state.tp_rank


def get_tp_world_size() -> int:
    return _state.tp_size


def tensor_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group (in place), returning it."""
    if _state.tp_size == 1:
        return x
    dist.all_reduce(x, group=_state.tp_group)
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if _state.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_state.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=_state.tp_group)
    return torch.cat(parts, dim=dim)


def tensor_parallel_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Overwrite `x` on every rank of the TP group with its TP rank 0's `x` (in place)."""
    if _state.tp_size == 1:
        return x
    dist.broadcast(x, src=_state.pp_rank * _state.tp_size, group=_state.tp_group)
    return x


def send_to_next_stage(tensors: list[torch.Tensor]) -> list[dist.Work]:
    """Start sending `tensors` (contiguous) to the same TP rank of the next stage; keep them alive
    and unchanged until the returned works are waited on."""
    dst = _state.rank + _state.tp_size
    return [dist.isend(t, dst=dst) for t in tensors]


def recv_from_prev_stage(tensors: list[torch.Tensor]) -> None:
    """Fill `tensors` (of the right shapes) from the same TP rank of the previous stage."""
    src = _state.rank - _state.tp_size
    for t in tensors:
        dist.recv(t, src=src)
