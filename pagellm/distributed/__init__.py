"""Tensor-parallel process state and collectives."""
from pagellm.distributed.parallel_state import (
    TensorParallelState,
    get_tp_rank,
    get_tp_world_size,
    init_tensor_parallel,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)

__all__ = [
    "TensorParallelState",
    "get_tp_rank",
    "get_tp_world_size",
    "init_tensor_parallel",
    "tensor_parallel_all_gather",
    "tensor_parallel_all_reduce",
]
