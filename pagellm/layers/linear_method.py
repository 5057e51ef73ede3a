"""How a linear layer (or the vocabulary) stores and multiplies its weight: the interface every
quantization method implements (`pagellm.quantization`), and the dense default."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.ops.dispatch import resolve_impl


class LinearMethod(ABC):
    """How one linear layer stores and multiplies its weight (the layer's `quant_method`)."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        """Register this rank's weight parameter(s) on `layer` ([output_size, input_size] logically),
        each with `weight_loader = layer.weight_loader`."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Turn the loaded parameters into what `apply` reads (no-op by default)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [T, input_size] -> x W^T + bias [T, output_size], in x's dtype."""

    @abstractmethod
    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [T] of W (a vocabulary table) -> [T, input_size] in the model's dtype."""


class UnquantizedLinearMethod(LinearMethod):
    """A dense weight in the model's dtype, multiplied with `F.linear`, or at one row on a GPU
    with the one-row kernel where start-up timed it faster (`dense_one_row`)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        # Device and dtype come from the caller's `torch.device(...)` context and default dtype.
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Batch-1 decode on a GPU only; other steps pay one comparison here.
        if x.shape[0] == 1 and x.dim() == 2 and bias is None and x.is_cuda and resolve_impl(x, None) == "triton":
            from pagellm.ops.triton import dense_one_row  # noqa: PLC0415 (Triton is optional)

            if dense_one_row.dense_gemv_is_faster(x, layer.weight):
                return dense_one_row.dense_gemv(x, layer.weight)
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


def process_weights_after_loading(modules: Iterable[nn.Module]) -> None:
    """Let every module's method finish its weights (after `load_weights`)."""
    for module in modules:
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
