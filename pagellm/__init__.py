"""pagellm: a paged-KV-cache LLM inference and serving engine.

The public names load lazily, so that `pagellm.core` (pure Python) imports without torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from pagellm.version import __version__

_EXPORTS = {
    "LLM": "pagellm.entrypoints.llm",
    "LLMEngine": "pagellm.engine.llm_engine",
    "EngineArgs": "pagellm.engine.arg_utils",
    "SamplingParams": "pagellm.sampling_params",
    "StructuredOutputsParams": "pagellm.sampling_params",
    "BeamSearchParams": "pagellm.entrypoints.beam_search",
    "RequestOutput": "pagellm.outputs",
    "CompletionOutput": "pagellm.outputs",
    "PoolingParams": "pagellm.pooling_params",
    "EmbeddingRequestOutput": "pagellm.outputs",
    "EmbeddingOutput": "pagellm.outputs",
    "LoRARequest": "pagellm.lora_request",
}
__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from pagellm.engine.arg_utils import EngineArgs
    from pagellm.engine.llm_engine import LLMEngine
    from pagellm.entrypoints.beam_search import BeamSearchParams
    from pagellm.entrypoints.llm import LLM
    from pagellm.lora_request import LoRARequest
    from pagellm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
    from pagellm.pooling_params import PoolingParams
    from pagellm.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagellm' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
