"""pagellm: a paged-KV-cache LLM inference and serving engine."""
from pagellm.config import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.llm import LLM
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
