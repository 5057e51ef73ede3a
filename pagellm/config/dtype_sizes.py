"""Bytes per stored element: model dtypes and KV-cache dtypes (a quantization method's bytes per
weight are in its registry entry, `pagellm.config.quantization`).

One place for these numbers, so that capacity planning (`pagellm plan`) and the engine agree.
"""
from __future__ import annotations

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
"""What --kv-cache-dtype accepts (vLLM's names): the model dtype, or float8 e4m3 (both fp8 names)."""


def kv_cache_element_bytes(kv_cache_dtype: str, dtype_bytes: int) -> int:
    """Bytes per cached K or V element: the model dtype ("auto") or one byte (fp8)."""
    if kv_cache_dtype == "auto":
        return dtype_bytes
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return 1
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
