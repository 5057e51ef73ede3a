"""Attention backends, chosen by name; each is imported only when asked for."""
from __future__ import annotations

import importlib

from pagellm.attention.backend import AttentionBackend, AttentionMetadata, KVCache

# name -> (module, class); modules load lazily so a CPU-only install never imports GPU kernels.
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("pagellm.attention.torch_backend", "TorchAttentionBackend"),
    "triton": ("pagellm.attention.triton_backend", "TritonAttentionBackend"),
    "cpu": ("pagellm.attention.cpu_backend", "CPUAttentionBackend"),
}
ATTENTION_BACKENDS = tuple(_BACKENDS)


def get_attn_backend(name: str) -> AttentionBackend:
    """A new instance of the attention backend called `name`."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; valid names: {', '.join(sorted(_BACKENDS))}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()


__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "KVCache", "get_attn_backend"]
