"""Per-request parameters of the pooling runner (embeddings), with vLLM's names. Pure Python (no torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PoolingParams:
    """How one prompt's embedding is returned. Every invalid value raises a ValueError naming the field."""

    normalize: bool | None = None
    """L2-normalize the vector; None: the engine's pooler_config (default true)."""
    dimensions: int | None = None
    """Length of the returned vector. Only models trained for truncated (Matryoshka) embeddings allow
    fewer dimensions than their hidden size; the decoder LMs pagellm runs are not, so this must be
    None or the hidden size (checked by the engine, which knows the model)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this-many prompt tokens (>= 1)."""

    def __post_init__(self) -> None:
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or None, got {self.normalize!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
