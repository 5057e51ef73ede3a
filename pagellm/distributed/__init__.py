"""Ranks of one model replica (tensor and pipeline parallel) and the collectives between them."""
from pagellm.distributed.parallel_state import (
    ParallelState,
    get_tp_rank,
    get_tp_world_size,
    init_distributed,
    init_tensor_parallel,
    parallel_state,
    recv_from_prev_stage,
    send_to_next_stage,
    stage_layers,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
    tensor_parallel_broadcast,
)

__all__ = [
    "ParallelState",
    "get_tp_rank",
    "get_tp_world_size",
    "init_distributed",
    "init_tensor_parallel",
    "parallel_state",
    "recv_from_prev_stage",
    "send_to_next_stage",
    "stage_layers",
    "tensor_parallel_all_gather",
    "tensor_parallel_all_reduce",
    "tensor_parallel_broadcast",
]
