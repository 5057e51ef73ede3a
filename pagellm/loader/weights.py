"""One entry point for a source's weights, whatever the format."""
from __future__ import annotations

from collections.abc import Collection, Iterator

import torch

from pagellm.loader.gguf_loader import iter_gguf_weights
from pagellm.loader.mxfp4 import iter_mxfp4_dequantized
from pagellm.loader.safetensors_loader import iter_safetensors_weights
from pagellm.loader.source import ModelSource


def iter_weights(source: ModelSource, keep_quantized: Collection[str] = ()) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_parameter_name, CPU tensor)` pairs, one tensor in memory at a time.

    GGUF weights come dequantized to float32 (those named in `keep_quantized`: as stored blocks)
    with q/k rows in Hugging Face order; safetensors weights keep their stored dtype, but for an
    MXFP4 checkpoint's (GPT-OSS's experts: `quant_method` mxfp4), which come dequantized to bfloat16
    (`pagellm.loader.mxfp4`). A tied `lm_head.weight` is not yielded when the checkpoint does not
    store it.
    """
    if source.load_format == "gguf":
        return iter_gguf_weights(source.path, keep_quantized)
    if source.load_format == "safetensors":
        quant_method = (source.arch.hf_config.get("quantization_config") or {}).get("quant_method")
        weights = iter_safetensors_weights(source.path)
        return iter_mxfp4_dequantized(weights) if quant_method == "mxfp4" else weights
    raise ValueError(
        f"source {source.path!r} has load_format {source.load_format!r}, which has no weights to read; "
        "use initialize_dummy_weights for dummy sources"
    )
