"""Quantized weights: the per-layer method seam (`base`) and the formats behind `--quantization`."""
from __future__ import annotations

import logging

import torch

from pagellm.quantization.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("gguf", "none")
"""What `--quantization` accepts (vLLM's names); None (the default) picks per model and device."""

__all__ = ["QUANTIZATION_METHODS", "LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod",
           "build_quant_config", "resolve_quantization"]


def resolve_quantization(requested: str | None, load_format: str, model_path: str, device: torch.device) -> str | None:
    """The method the engine will use ("gguf"), or None for dense weights in the model's dtype.

    Default: a GGUF file on the CPU stays quantized when the kernels can run here (else it is
    dequantized at load, with a warning saying why); every other model is dense.
    """
    from pagellm.quantization import ggml_cpu  # noqa: PLC0415 (builds the kernels on first use)

    if requested == "none":  # (EngineArgs.validate has checked the name)
        return None
    if requested is None:
        if load_format != "gguf" or device.type != "cpu":
            return None
        reason = ggml_cpu.unavailable_reason()
        if reason is not None:
            logger.warning("%s; the GGUF weights are dequantized at load instead (slower)", reason)
            return None
        return "gguf"
    if load_format != "gguf":
        raise ValueError(f"quantization (--quantization) 'gguf' needs a .gguf model, but {model_path!r} is loaded "
                         f"as {load_format}")
    if device.type != "cpu":
        raise ValueError(f"quantization (--quantization) 'gguf' runs on the CPU only so far; on {device} pass "
                         "--quantization none to dequantize the GGUF weights at load")
    reason = ggml_cpu.unavailable_reason()
    if reason is not None:
        raise ValueError(f"quantization (--quantization) 'gguf' cannot run here: {reason}; pass --quantization none")
    return "gguf"


def build_quant_config(method: str | None, model_path: str) -> QuantizationConfig | None:
    """The per-layer config of a resolved `method` for the model at `model_path`."""
    if method is None:
        return None
    from pagellm.quantization.gguf import GGUFConfig  # noqa: PLC0415

    return GGUFConfig.from_file(model_path)
