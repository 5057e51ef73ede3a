"""Linear layers whose weights are split across tensor-parallel ranks.

Column parallel: each rank owns a slice of the output features, so no communication is needed.
Row parallel: each rank owns a slice of the input features and the partial products are summed
over ranks. Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`, which
copies this rank's slice of a full (unsharded) checkpoint tensor into it.

A quantization method may store a weight in another shape than [output_size, input_size] (packed
int4, a scale per group or per channel): its parameters say which of their dims run along the
output and input features (`output_dim`, `input_dim`; None: not split that way), and the loaders
scale each slice by how the parameter's length along that dim relates to the layer's size.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from pagellm.distributed import get_tp_rank, get_tp_world_size, tensor_parallel_all_reduce
from pagellm.layers.linear_method import LinearMethod, UnquantizedLinearMethod


def copy_weight(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` into `dst` (casting dtype and device), refusing silent broadcasts and casts
    between kinds of numbers (quantized codes read as values, or the reverse)."""
    if dst.shape != src.shape:
        raise ValueError(
            f"checkpoint tensor of shape {tuple(src.shape)} does not fit a parameter (shard) of shape "
            f"{tuple(dst.shape)}; does config.json describe the same model as the weights?"
        )
    if _kind(dst.dtype) != _kind(src.dtype):
        raise ValueError(f"checkpoint tensor of type {src.dtype} does not fit a parameter of type {dst.dtype}: does "
                         "the checkpoint's quantization_config (or --quantization) describe how it is stored?")
    dst.copy_(src)


def _kind(dtype: torch.dtype) -> str:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "float8"
    return "float" if dtype.is_floating_point else "integer"


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Loader for parameters that every rank holds whole (norm weights, replicated biases)."""
    if shard_id is not None:
        raise ValueError(f"this parameter is not stacked from several checkpoint tensors (got shard_id={shard_id!r})")
    copy_weight(param.data, loaded_weight)


def output_dim(param: nn.Parameter) -> int | None:
    """The dim of `param` that runs along the layer's output features (default 0)."""
    return getattr(param, "output_dim", 0)


def input_dim(param: nn.Parameter) -> int | None:
    """The dim of `param` that runs along the layer's input features (default 1)."""
    return getattr(param, "input_dim", 1)


def _along(param: nn.Parameter, dim: int, logical_size: int, *logical: int) -> list[int]:
    """Offsets and sizes in features (`logical`) as lengths of `param` along `dim`, whose full
    length stands for `logical_size` features (a packed or grouped dim is shorter)."""
    scaled = [x * param.shape[dim] // logical_size for x in logical]
    if any(x * param.shape[dim] % logical_size for x in logical):
        raise ValueError(f"a slice of {logical} features does not fall on whole elements of a parameter of "
                         f"shape {tuple(param.shape)} ({param.shape[dim]} elements along dim {dim} for "
                         f"{logical_size} features): the tensor-parallel split cuts a packed element or group")
    return scaled


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator // denominator`, or a ValueError saying which size does not split evenly."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})")
    return numerator // denominator


def _new_param(*shape: int) -> nn.Parameter:
    # Device and dtype come from the caller's `torch.device(...)` context and default dtype.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class _ParallelLinear(nn.Module, ABC):
    """y = x W^T + b with this rank's [output_size, input_size] slice of W, stored and multiplied
    by the layer's `quant_method`."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        """This rank's sizes."""
        self.set_quant_method(UnquantizedLinearMethod())
        if bias:
            self.bias = _new_param(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def set_quant_method(self, method: LinearMethod) -> None:
        """Store and multiply the weight with `method` (before loading: it creates the weight, in
        place of the previous method's)."""
        for name, _ in list(self.named_parameters(recurse=False)):
            if name != "bias":
                delattr(self, name)
        self.quant_method = method
        method.create_weights(self, self.input_size, self.output_size)

    @abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's slice of the full checkpoint tensor `loaded_weight` into `param`."""

    def parts(self) -> list[tuple[object, int, int]]:
        """(shard_id, first row, rows) of each checkpoint tensor this rank's weight is stacked
        from, in order: one part (shard_id None) but for fused layers."""
        return [(None, 0, self.output_size)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(_ParallelLinear):
    """Every rank holds the whole weight and computes the whole output (a small layer whose input
    and output every rank needs, such as a mixture-of-experts router)."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)


class ColumnParallelLinear(_ParallelLinear):
    """Output features split evenly across ranks; each rank returns its slice of y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, get_tp_world_size(), "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} loads one unstacked tensor (got shard_id={shard_id!r})")
        dim = output_dim(param)
        if dim is None:
            copy_weight(param.data, loaded_weight)
            return
        size = param.shape[dim]
        copy_weight(param.data, loaded_weight.narrow(dim, get_tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one matmul (gate_up).

    This rank's output is [its slice of part 0, its slice of part 1, ...]; `shard_id` is the part's
    index in `output_sizes`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        tp = get_tp_world_size()
        shard_sizes = [divide(size, tp, "stacked output size") for size in output_sizes]
        super().__init__(input_size, sum(output_sizes), bias)
        self.shard_sizes = shard_sizes

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shard_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.shard_sizes)}, got {shard_id!r}")
        dim = output_dim(param)
        if dim is None:  # the same for every part (GPTQ's g_idx)
            copy_weight(param.data, loaded_weight)
            return
        _, offset, size = self.parts()[shard_id]
        offset, size = _along(param, dim, self.output_size, offset, size)
        copy_weight(param.data.narrow(dim, offset, size), loaded_weight.narrow(dim, get_tp_rank() * size, size))

    def parts(self) -> list[tuple[object, int, int]]:
        return [(i, sum(self.shard_sizes[:i]), size) for i, size in enumerate(self.shard_sizes)]


class QKVParallelLinear(_ParallelLinear):
    """The fused q/k/v projection, split by attention head.

    Each rank gets `num_heads / tp` query heads. KV heads are split the same way, except when
    there are fewer KV heads than ranks: then each rank holds one KV head, replicated on the
    `tp / num_kv_heads` consecutive ranks whose query heads share it (GQA).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp = get_tp_world_size()
        heads = divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            kv_heads, kv_replicas = divide(num_kv_heads, tp, "num_key_value_heads"), 1
        elif tp % num_kv_heads:
            raise ValueError(
                f"tensor-parallel size ({tp}) exceeds num_key_value_heads ({num_kv_heads}) "
                "and so must be a multiple of it"
            )
        else:
            kv_heads, kv_replicas = 1, tp // num_kv_heads
        super().__init__(hidden_size, (heads + 2 * kv_heads) * head_dim, bias)
        self.num_heads = heads
        self.num_kv_heads = kv_heads
        self.kv_replicas = kv_replicas
        self.q_size = heads * head_dim
        self.kv_size = kv_heads * head_dim

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        part = next((p for p in self.parts() if p[0] == shard_id), None)
        if part is None:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        _, offset, size = part
        rank = get_tp_rank()
        src_start = rank * size if shard_id == "q" else (rank // self.kv_replicas) * size
        dim = output_dim(param)
        if dim is None:  # the same for every part (GPTQ's g_idx)
            copy_weight(param.data, loaded_weight)
            return
        offset, size, src_start = _along(param, dim, self.output_size, offset, size, src_start)
        copy_weight(param.data.narrow(dim, offset, size), loaded_weight.narrow(dim, src_start, size))

    def parts(self) -> list[tuple[object, int, int]]:
        q, kv = self.q_size, self.kv_size
        return [("q", 0, q), ("k", q, kv), ("v", q + kv, kv)]


class RowParallelLinear(_ParallelLinear):
    """Input features split across ranks; partial outputs are summed with an all-reduce, or left
    partial (`reduce_results=False`) for a caller that sums them with other partial results in one
    all-reduce of its own."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__(divide(input_size, get_tp_world_size(), "input size"), output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} loads one unstacked tensor (got shard_id={shard_id!r})")
        dim = None if param is self.bias else input_dim(param)
        if dim is None:
            copy_weight(param.data, loaded_weight)
            return
        size = param.shape[dim]
        copy_weight(param.data, loaded_weight.narrow(dim, get_tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Only rank 0 adds the bias, so the all-reduce sums it in exactly once.
        bias = self.bias if get_tp_rank() == 0 else None
        out = self.quant_method.apply(self, x, bias)
        return tensor_parallel_all_reduce(out) if self.reduce_results else out
