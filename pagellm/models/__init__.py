"""Model definitions, looked up by Hugging Face architecture name in `MODEL_REGISTRY` (the table
lives in `pagellm.config.arch`, where the config and the GGUF loader read it too) and imported
lazily. `register_model` adds an architecture, checked against `interface.CausalLM`."""
from __future__ import annotations

import functools

from pagellm.config.arch import MODEL_REGISTRY, ArchitectureEntry
from pagellm.config.registry import check_ref, resolve
from pagellm.models.interface import CausalLM, check_model_class


def register_model(architecture: str, model_cls: type[CausalLM] | str, *, gguf_arch: str | None = None,
                   model_type: str | None = None, override: bool = False) -> None:
    """Run checkpoints whose config.json lists `architecture` with `model_cls` (a class implementing
    `CausalLM`, or its "package.module:Class" name, imported and checked on first use, so that a
    plugin need not import torch to register). `gguf_arch`: the GGUF `general.architecture` its
    GGUF files have, if they load (`model_type`: the Hugging Face one, for their config). A name
    already registered is refused unless `override`."""
    if isinstance(model_cls, str):
        check_ref(model_cls, f"register_model({architecture!r})")
    else:
        check_model_class(model_cls, architecture)
    MODEL_REGISTRY.register(ArchitectureEntry(architecture, model_cls, gguf_arch, model_type or gguf_arch),
                            override=override)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The model class implementing Hugging Face `architecture`."""
    return _checked(MODEL_REGISTRY.get(architecture).cls, architecture)


@functools.cache
def _checked(ref: object, architecture: str) -> type[CausalLM]:
    return check_model_class(resolve(ref), architecture)


__all__ = ["MODEL_REGISTRY", "CausalLM", "get_model_class", "register_model"]
