"""The quantization seam: how a linear layer's (or the vocabulary's) weights are created, loaded
and applied, chosen per layer by a `QuantizationConfig`.

A layer is built with `UnquantizedLinearMethod`; `QuantizationConfig.apply(model)` then gives
each layer the config chooses a method of its own, which replaces the layer's parameters before
any weight is loaded. The layer's own `weight_loader` keeps deciding which slice of a checkpoint
tensor is this rank's (rows for column-parallel layers, columns for row-parallel ones), so a
method whose parameter keeps the checkpoint's row/column structure (GGUF blocks are row-major,
32 values per block) needs no loader of its own. After loading, `process_weights_after_loading`
turns what was loaded into what `apply` reads.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn


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
    """A dense weight in the model's dtype, multiplied with `F.linear`."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        # Device and dtype come from the caller's `torch.device(...)` context and default dtype.
        layer.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


class QuantizationConfig(ABC):
    """A checkpoint's (or a flag's) quantization: which method each layer gets."""

    name: str

    @abstractmethod
    def apply(self, model: nn.Module) -> set[str]:
        """Give the layers this config quantizes their methods (before loading); returns the
        checkpoint tensor names whose weights the loader must hand over as stored."""


def process_weights_after_loading(modules: Iterable[nn.Module]) -> None:
    """Let every module's method finish its weights (after `load_weights`)."""
    for module in modules:
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
