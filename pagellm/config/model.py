"""What model runs and how: where its checkpoint is (`ModelSource`), its numbers and limits
(`ModelConfig`), the pooling runner's pooler, and a draft model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagellm.config.arch import ModelArchConfig
from pagellm.config.json_flags import json_object
from pagellm.config.multimodal import MultiModalConfig

RUNNERS = ("generate", "pooling")
POOLING_TYPES = ("LAST", "MEAN", "CLS")


@dataclass(slots=True)
class ModelSource:
    """A resolved local model: where it is, how to load it, and its architecture."""

    path: str
    """A `.gguf` file, a Hugging Face directory, or a preset name (dummy only)."""
    load_format: str
    """Resolved format: "gguf", "safetensors" or "dummy"."""
    arch: ModelArchConfig
    generation_config: dict[str, Any] = field(default_factory=dict)
    """Hugging Face `generation_config.json` content ({} if none); GGUF gives bos/eos/pad ids."""
    tokenizer: str | None = None
    """A tokenizer other than the model's own (`--tokenizer`): a `.gguf` file or a directory with
    tokenizer.json; None: the model's."""


@dataclass(slots=True, frozen=True)
class PoolerConfig:
    """How the pooling runner turns a prompt's final hidden states into one vector (vLLM's names)."""

    pooling_type: str = "LAST"
    """LAST: the last prompt token's hidden state; MEAN: the mean over the prompt; CLS: the first token's."""
    normalize: bool = True
    """L2-normalize the vector, unless a request's PoolingParams says otherwise."""

    @classmethod
    def parse(cls, value: "str | dict | PoolerConfig | None", runner: str) -> "PoolerConfig | None":
        """`--pooler-config` (JSON text, a dict, or a PoolerConfig) -> the config of the pooling
        runner, None for the generate runner. Fails naming the flag."""
        if runner != "pooling":
            if value is not None:
                raise ValueError("pooler_config (--pooler-config) applies only with runner='pooling' "
                                 "(--runner pooling)")
            return None
        if value is None or isinstance(value, cls):
            return value or cls()
        value = json_object(value, "pooler_config (--pooler-config)", ("pooling_type", "normalize"))
        pooling_type = value.get("pooling_type", "LAST")
        if not isinstance(pooling_type, str) or pooling_type.upper() not in POOLING_TYPES:
            raise ValueError(f"pooler_config (--pooler-config) pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {pooling_type!r}")
        normalize = value.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"pooler_config (--pooler-config) normalize must be true or false, got {normalize!r}")
        return cls(pooling_type.upper(), normalize)


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """The model the engine runs, and how its weights, activations and outputs are computed."""

    source: ModelSource
    dtype: torch.dtype
    """The activations' (and dense weights') dtype."""
    max_model_len: int
    """Longest prompt + output, in tokens."""
    attention_backend: str
    """The attention implementation's name (`pagellm.attention`)."""
    quantization: str | None = None
    """The weights' quantization method (`pagellm.quantization`); None: dense in `dtype`."""
    seed: int = 0
    """Seed of dummy weights and of sampling for requests without their own seed."""
    max_logprobs: int = 20
    """Most logprobs / prompt_logprobs a request may ask for per token."""
    enforce_eager: bool = False
    """No CUDA graphs for decode steps."""
    pooler: PoolerConfig | None = None
    """The pooling runner's pooler; None for the generate runner."""
    multimodal: MultiModalConfig = field(default_factory=lambda: MultiModalConfig.parse(None, None, None))
    """How many images a prompt may carry, and where the server may read them from."""

    @property
    def is_pooling(self) -> bool:
        return self.pooler is not None


@dataclass(slots=True, frozen=True)
class DraftModelConfig:
    """The draft model of draft_model speculation, resolved as the target is (same dtype, device
    and attention backend)."""

    source: ModelSource
    quantization: str | None
