"""The engine's configuration types (pure data, no engine imports), one sub-config per concern.

`pagellm.engine.arg_utils.EngineArgs` turns what a user passes into an `EngineConfig`.
"""
from pagellm.config.arch import ModelArchConfig
from pagellm.config.engine import CacheConfig, EngineConfig, ParallelConfig, SchedulerConfig, StructuredOutputsConfig
from pagellm.config.grammar_limits import GrammarLimits
from pagellm.config.lora import LoRAConfig
from pagellm.config.model import DraftModelConfig, ModelConfig, ModelSource, PoolerConfig
from pagellm.config.multimodal import MultiModalConfig
from pagellm.config.speculative import SpeculativeConfig

__all__ = [
    "CacheConfig", "DraftModelConfig", "EngineConfig", "GrammarLimits", "LoRAConfig", "ModelArchConfig", "ModelConfig",
    "ModelSource", "MultiModalConfig", "ParallelConfig", "PoolerConfig", "SchedulerConfig", "SpeculativeConfig",
    "StructuredOutputsConfig",
]
