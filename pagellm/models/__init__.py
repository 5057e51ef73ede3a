"""Model definitions, looked up by Hugging Face architecture name and imported lazily."""
from __future__ import annotations

import importlib

from torch import nn

# architecture -> (module under pagellm.models, class)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The model class implementing Hugging Face `architecture`."""
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: {', '.join(_MODELS)}")
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(f"pagellm.models.{module}"), cls)
