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

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pagellm.distributed import get_tp_world_size
from pagellm.layers.linear import RowParallelLinear, _ParallelLinear
from pagellm.layers.linear_method import LinearMethod


@dataclass(frozen=True, slots=True)
class Calibration:
    """A prompt the loaded model runs over while a method that quantizes at load measures its
    layers' inputs. The worker provides it: it tokenizes and lays out batches, the methods cannot."""

    token_ids: list[int]
    forward: Callable[[nn.Module, list[int]], object]
    """Runs a model over one prompt from position 0 (what it returns is not used)."""


CalibrationSource = Callable[[str], "Calibration | None"]
"""A calibration text -> its prompt for the model being loaded, or None (after a warning saying why)
where the model cannot be calibrated: a pipeline stage holds part of it, or it has no tokenizer."""


class QuantizableLayer(Protocol):
    """What quantizing at load (`smoothing`) calls on a model's decoder layer."""

    def smoothable(self) -> list[tuple[nn.Module, nn.Module]]:
        """(norm, linear layer reading only its output) pairs whose per-channel scales may be moved
        from the norm's weight into the layer's input columns (SmoothQuant, AWQ); [] for none."""

    def clippable(self) -> list[nn.Module]:
        """Linear layers whose weights' range may be clipped judging by their own product (AWQ)."""


class QuantizableModel(Protocol):
    """What quantization calls on a model: `pagellm.models.interface.CausalLM` extends it."""

    def checkpoint_names(self, param_name: str) -> list[str]:
        """The checkpoint tensor names parameter `param_name` is loaded from (several for a fused one)."""

    def decoder_layers(self) -> Sequence[QuantizableLayer]:
        """This rank's (pipeline stage's) decoder layers, in order."""

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


class QuantizationConfig(ABC):
    """A checkpoint's (or a flag's) quantization: which method each layer gets."""

    name: str

    @abstractmethod
    def apply(self, model: QuantizableModel) -> set[str]:
        """Give the layers this config quantizes their methods (before loading); returns the
        checkpoint tensor names whose weights the loader must hand over as stored."""

    def prepare_weights(self, model: QuantizableModel, calibration: CalibrationSource) -> None:
        """Work on the loaded model before the methods process their weights (a method that
        quantizes at load calibrates here); nothing by default."""


class LinearLayersConfig(QuantizationConfig):
    """A config that gives every linear layer (not the embedding or LM head) a `method_cls(fmt)`,
    except the layers the checkpoint lists as left dense."""

    method_cls: type[LinearMethod]

    def __init__(self, name: str, fmt: object, ignored: Iterable[str] = ()) -> None:
        self.name = name
        self.fmt = fmt
        """How the layers are stored (the method's format dataclass)."""
        self.ignored = tuple(ignored)
        """Checkpoint module names (or "re:" patterns, as llm-compressor writes them) kept dense."""

    def method(self) -> LinearMethod:
        """A new method for one layer."""
        return self.method_cls(self.fmt)

    def apply(self, model: QuantizableModel) -> set[str]:
        for prefix, module in model.named_modules():
            if isinstance(module, _ParallelLinear) and not self._is_ignored(model.checkpoint_names(f"{prefix}.weight")):
                module.set_quant_method(self.method())
        return set()

    def _is_ignored(self, names: list[str]) -> bool:
        modules = [name.removesuffix(".weight") for name in names]
        hits = [any(_matches(pattern, m) for pattern in self.ignored) for m in modules]
        if any(hits) and not all(hits):
            raise ValueError(f"the checkpoint keeps some of {modules} dense and quantizes the others; pagellm fuses "
                             "them into one layer, which needs one format")
        return all(hits)


def _matches(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def per_channel_loader(layer: nn.Module):
    """A weight loader for a per-output-channel scale [N] that also takes a checkpoint's per-tensor
    scalar (every row of that tensor gets it: a fused layer keeps each part's own) or [N, 1]."""

    # As long as the checkpoint's tensor would be: a row-parallel layer's outputs are whole.
    full_rows = 1 if isinstance(layer, RowParallelLinear) else get_tp_world_size()

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        flat = loaded.reshape(-1).float()
        if flat.numel() == 1:  # a view: the layer's loader takes whichever rows are this rank's
            flat = flat.expand(param.shape[0] * full_rows)
        layer.weight_loader(param, flat, shard_id)

    return load


def new_param(shape: tuple[int, ...], dtype: torch.dtype, loader, output_dim: int | None = 0,
              input_dim: int | None = 1) -> nn.Parameter:
    """A parameter (frozen) that the layer's loaders slice along `output_dim` / `input_dim`."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader, param.output_dim, param.input_dim = loader, output_dim, input_dim
    return param


def replace_param(layer: nn.Module, name: str, value: torch.Tensor | None) -> None:
    """Swap a loaded parameter for what `apply` reads (None: drop it)."""
    delattr(layer, name)
    if value is not None:
        setattr(layer, name, nn.Parameter(value, requires_grad=False))
