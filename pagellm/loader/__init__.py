"""Model sources: local GGUF files, Hugging Face safetensors directories, and dummy presets."""
from pagellm.loader.dummy import initialize_dummy_weights
from pagellm.loader.presets import PRESETS
from pagellm.loader.source import LOAD_FORMATS, ModelSource, default_model_path, resolve_model
from pagellm.loader.weights import iter_weights

__all__ = [
    "LOAD_FORMATS",
    "PRESETS",
    "ModelSource",
    "default_model_path",
    "initialize_dummy_weights",
    "iter_weights",
    "resolve_model",
]
