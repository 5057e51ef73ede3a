"""GGUF-quantized matrix products on the CPU: the kernels of `ggml_cpu.c`, built on first use.

Why our own C: PyTorch's CPU weight-only kernels (`_weight_int4pack_mm_for_cpu`,
`_weight_int8pack_mm`, fbgemm's dynamic int8 linear) were measured on this project's 2-core AVX2
machine at SmolLM2-135M shapes: the fastest took 16 ms per token for the matrix products alone
at batch 1 (2.1x llama.cpp's whole token), and the fast int8 one quantizes activations per
tensor, which broke greedy agreement (28/123 tokens). The C file is the llama.cpp recipe (Q8
blocks of activations, integer dot products) in ~200 lines, compiled once per machine with the
system C compiler (about a second) into a per-user cache; without a compiler or AVX2 the GGUF
weights are dequantized at load instead, with a warning.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ggml_cpu.c")
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}
"""GGML type id -> bytes per 32-value block, for the types the kernels take: Q4_0, Q4_1, Q8_0."""
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None: they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the GGUF CPU kernels need an x86-64 CPU, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the GGUF CPU kernels need AVX2 and FMA, which this CPU lacks"
    if _compiler() is None:
        return "no C compiler (cc, gcc or $CC) was found to build the GGUF CPU kernels"
    try:
        _library()
    except subprocess.CalledProcessError as e:
        return f"building the GGUF CPU kernels failed: {e.stderr.strip()[-500:]}"
    except OSError as e:
        return f"building or loading the GGUF CPU kernels failed: {e}"
    return None


def gemm(qtype: int, x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T, W the raw GGUF blocks [out_features, K / 32 * block bytes] -> [M, out_features]."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    _check(_library().ggml_gemm(qtype, x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), out_features,
                                out.data_ptr()))
    return out


def round_to_q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 rounded as `gemm` rounds activations: per 32-value block to int8 steps of
    max|x| / 127, so that a BLAS product with the dequantized weight gives what `gemm` gives."""
    blocks = x.reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, 0)
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


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


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def _library() -> ctypes.CDLL:
    """Build (once per source and compiler flags) and load the kernels. Loaded after torch, the
    library's libgomp dependency resolves to the one torch already loaded: one OpenMP pool."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagellm"
    path = cache / f"ggml_cpu-{key}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written file.
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            pass
        try:
            subprocess.run([_compiler(), *_FLAGS, "-o", tmp.name, str(SOURCE)], check=True,
                           capture_output=True, text=True)
            os.replace(tmp.name, path)
        finally:
            if os.path.exists(tmp.name):
                os.unlink(tmp.name)
        logger.info("built the GGUF CPU kernels into %s", path)
    lib = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ggml_gemm.argtypes = [ctypes.c_int, ptr, i64, i64, ptr, i64, ptr]
    lib.ggml_dequantize.argtypes = [ctypes.c_int, ptr, i64, i64, ptr]
    return lib
