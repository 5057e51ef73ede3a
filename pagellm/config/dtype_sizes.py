"""Bytes per stored element: model dtypes, weight quantization methods and KV-cache dtypes.

One place for these numbers, so that capacity planning (`pagellm plan`) and the quantization
methods (`pagellm.quantization`) agree; `rtn` stores what gptq and awq do.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""What --kv-cache-dtype accepts (vLLM's names): the model dtype, or float8 e4m3 (both fp8 names)."""

INT4_GROUP_SIZE = 128
"""Weights per scale (and zero point) in GPTQ and AWQ checkpoints, the common choice."""
_INT4_GROUP_OVERHEAD_BYTES = 2 + 1
"""Per group of INT4_GROUP_SIZE weights: a 16-bit scale and a zero point (a byte, as the engine keeps it)."""


def quantized_weight_bytes(method: str, dtype_bytes: int) -> float:
    """Bytes per weight of a linear layer stored with `method` ("none": the model dtype).

    fp8 and int8 store one byte per weight (their per-tensor or per-channel scales are negligible);
    gptq and awq store 4 bits plus a scale and a zero point per group of 128 weights.
    """
    if method == "none":
        return float(dtype_bytes)
    if method in ("fp8", "int8"):
        return 1.0
    if method in ("gptq", "awq", "rtn"):
        return 0.5 + _INT4_GROUP_OVERHEAD_BYTES / INT4_GROUP_SIZE
    raise ValueError(f"no size per weight for quantization {method!r}: none, fp8, int8, gptq, awq or rtn")


def kv_cache_element_bytes(kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes per cached K or V element: the model dtype ("auto") or one byte (fp8)."""
    if kv_cache_dtype == "auto":
        return dtype_bytes
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return 1
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
