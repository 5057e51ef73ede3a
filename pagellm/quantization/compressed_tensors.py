"""llm-compressor's compressed-tensors checkpoints: 8-bit weights (float or int) load as `w8a8`,
4-bit ones (pack-quantized) as `int4`."""
from __future__ import annotations

from typing import Any

from pagellm.quantization import compressed_tensors_weights, int4, w8a8
from pagellm.quantization.base import QuantizationConfig


def build(method: str, model_path: str, hf_config: dict[str, Any]) -> QuantizationConfig:
    """The registry's builder of compressed-tensors (`QuantizationMethod.build`)."""
    weights = compressed_tensors_weights(hf_config.get("quantization_config") or {})
    return (w8a8 if weights["num_bits"] == 8 else int4).build(method, model_path, hf_config)
