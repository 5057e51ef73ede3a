"""GGUF-quantized matrix products on the CPU: the kernels of `ggml_cpu.c`, built on first use.

Why our own C: PyTorch's CPU weight-only kernels (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`, fbgemm's dynamic int8 linear) were measured on this project's 2-core AVX2
machine at SmolLM2-135M shapes: the fastest took 16 ms per token for the matrix products alone
at batch 1 (2.1x llama.cpp's whole token), and the int8 ones round activations (per tensor, or
to bfloat16), which broke greedy agreement (28/123 tokens for fbgemm's). The C file multiplies
the GGUF blocks as they are with float32 activations, compiled once per machine with the system
C compiler (`pagellm.ops.c.build`); without a compiler or AVX2 the GGUF weights are
dequantized at load instead, with a warning.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from pagellm.ops.c import build as native


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None: they can)."""
    return native.unavailable_reason()


def gemm(qtype: int, x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T, W the raw GGUF blocks [out_features, K / 32 * block bytes] -> [M, out_features]."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _check(_library().ggml_gemm(qtype, x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), out_features,
                                out.data_ptr()))
    return out


def dequantize(qtype: int, weight: torch.Tensor, in_features: int) -> torch.Tensor:
    """Raw GGUF blocks [R, in_features / 32 * block bytes] -> their exact float32 values [R, in_features]."""
    out = torch.empty(weight.shape[0], in_features, dtype=torch.float32)
    _check(_library().ggml_dequantize(qtype, weight.data_ptr(), weight.shape[0], in_features, out.data_ptr()))
    return out


def _check(status: int) -> None:
    if status == -1:
        raise ValueError("unsupported GGML type, or an input size that is not a multiple of 32")
    if status == -2:
        raise MemoryError("the GGUF CPU kernel could not allocate its scratch memory")


@functools.cache
def _library() -> ctypes.CDLL:
    lib = native.library()
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ggml_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.ggml_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    return lib
