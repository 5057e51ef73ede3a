"""The interface a model implements: exactly what the worker, the loaders, quantization, the
benchmarks and the evaluation call on it, whether it is pagellm's or a plugin's.

A model is a `torch.nn.Module` built as `cls(config, attn_backend)` on the device and dtype the
worker sets as defaults; it looks like the Hugging Face architecture it loads (checkpoint tensor
names), computes a flat batch (no padding, `AttentionMetadata` says where each sequence is), and
holds one pipeline stage's layers when pipeline parallelism splits it (`parallel_state()` says
which). `register_model` checks a class against `CausalLM` before it accepts it.
"""
from __future__ import annotations

import inspect
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.attention.layer import Attention
from pagellm.config.arch import ModelArchConfig
from pagellm.quantization.base import QuantizableLayer, QuantizableModel

IntermediateTensors = tuple[torch.Tensor, torch.Tensor]
"""(hidden, residual) [T, hidden_size] each: what one pipeline stage hands the next."""


@runtime_checkable
class CausalLM(QuantizableModel, Protocol):
    """A decoder-only language model (also the quantization target: `QuantizableModel`'s
    `checkpoint_names` and `decoder_layers`)."""

    config: ModelArchConfig

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        """Build this rank's shard (tensor parallel) of this stage's layers (pipeline parallel),
        every attention layer computing with `attn_backend`; weights uninitialized."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions [T] of the flat batch -> final hidden states [T, hidden_size] on the
        last pipeline stage; on the others, the `intermediate` the next stage takes (which a stage
        other than the first takes in place of `input_ids`)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in the model's dtype (a tensor-parallel
        collective: every rank of the last stage calls it)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint (Hugging Face-named) tensors into this rank's parameters, skipping other
        stages' tensors; returns the names of the parameters now fully loaded (the loader reports
        the others as missing)."""

    def attention_layers(self) -> list[Attention]:
        """This stage's attention layers, in order: the worker binds each its KV cache."""

    def decoder_layers(self) -> Sequence[QuantizableLayer]:
        """This stage's decoder layers, in order (quantization at load calibrates through them; the
        CPU worker fuses those that are Llama's into one C call, `cpu_layer`)."""

    # torch.nn.Module's, which the callers use too.
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                 intermediate: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def buffers(self) -> Iterator[torch.Tensor]: ...

    def eval(self) -> CausalLM: ...


MultiModalEmbeds = tuple[torch.Tensor, torch.Tensor]
"""(rows [N] int64 of the flat batch, features [N, hidden_size]): input embeddings that replace the
token embeddings of those rows (an image's placeholder tokens)."""


@runtime_checkable
class SupportsImages(Protocol):
    """A `CausalLM` that also takes images (LLaVA, Qwen2-VL): the worker encodes them and hands the features
    of the placeholder tokens each step computes to `forward`."""

    def encode_images(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        """pixel_values [B, 3, H, W] (the Hugging Face processor's), or [B, patches, patch values]
        with each image's `image_grid_thw` [B, 3] (a dynamic-resolution tower, every image of the
        call the same grid) -> features [B, N, hidden_size], N the placeholder tokens of each image."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata,
                intermediate: IntermediateTensors | None = None,
                mm_embeds: MultiModalEmbeds | None = None) -> torch.Tensor | IntermediateTensors:
        """`CausalLM.forward`, the rows of `mm_embeds` embedded as its features instead of their tokens."""


def _protocol_methods(protocol: type) -> tuple[str, ...]:
    """The methods `protocol` and the protocols it extends declare (those a class must have)."""
    names: dict[str, None] = {}
    for base in reversed(protocol.__mro__):
        if base.__dict__.get("_is_protocol") and base is not Protocol:
            names.update((name, None) for name, value in vars(base).items()
                         if inspect.isfunction(value) and (not name.startswith("_") or name == "__call__"))
    return tuple(names)


CAUSAL_LM_METHODS = _protocol_methods(CausalLM)
"""What `check_model_class` asks of a model class."""


def check_model_class(cls: object, architecture: str) -> type[CausalLM]:
    """`cls` if it implements `CausalLM`, else a ValueError saying what it lacks."""
    what = f"the model class registered for {architecture!r}"
    if not isinstance(cls, type) or not issubclass(cls, nn.Module):
        raise ValueError(f"{what} must be a torch.nn.Module subclass implementing "
                         f"pagellm.models.interface.CausalLM, got {cls!r}")
    name = f"{cls.__module__}.{cls.__qualname__}"
    missing = [method for method in CAUSAL_LM_METHODS if not callable(getattr(cls, method, None))]
    if missing:
        raise ValueError(f"{what}, {name}, lacks {', '.join(missing)} of pagellm.models.interface.CausalLM "
                         f"(needs {', '.join(CAUSAL_LM_METHODS)})")
    try:
        inspect.signature(cls).bind(None, None)
    except TypeError as e:
        raise ValueError(f"{what}, {name}, must be constructed as cls(config, attn_backend): {e}") from None
    except ValueError:  # no signature to inspect (a builtin); the constructor call will tell
        pass
    return cls
