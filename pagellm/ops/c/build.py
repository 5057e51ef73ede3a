"""C kernels for the CPU, compiled on first use with the system C compiler and cached per user.

One library is built from all the sources, once per their text and flags (about two seconds) into
the cache folder (`pagellm.config.cache_dirs`: PAGELLM_CACHE_ROOT, else ~/.cache/pagellm), then
loaded with ctypes. Loaded after torch, its OpenMP dependency resolves to the libgomp torch already
loaded: one thread pool for both. Callers check `unavailable_reason()` and fall back to PyTorch
where it is not None.
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

from pagellm.config.cache_dirs import cache_root

logger = logging.getLogger(__name__)

_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")


_HERE = Path(__file__).resolve().parent
SOURCES = (_HERE / "cpu_kernels.c", _HERE / "ggml_cpu.c", _HERE / "cpu_layer.c")
"""Built together into one library: the decoder-layer call (cpu_layer.c) calls the others."""
HEADER = _HERE / "cpu_kernels.h"


def unavailable_reason() -> str | None:
    """Why the CPU kernels cannot run here (None: they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU kernels need an x86-64 CPU, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU kernels need AVX2 and FMA, which this CPU lacks"
    if compiler() is None:
        return "no C compiler (cc, gcc or $CC) was found to build the CPU kernels"
    try:
        library()
    except subprocess.CalledProcessError as e:
        output = (e.stderr or "").strip()[-500:] or "no output"
        return f"building the CPU kernels failed ({e.cmd[0]} exited with status {e.returncode}: {output})"
    except OSError as e:
        return f"building or loading the CPU kernels failed: {e}"
    return None


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled kernels (built now if these sources and flags were never built here)."""
    digest = hashlib.sha256(" ".join(_FLAGS).encode())
    for path in (*SOURCES, HEADER):
        digest.update(path.read_bytes())
    cache = cache_root()
    path = cache / f"cpu_kernels-{digest.hexdigest()[:16]}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written file.
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            pass
        try:
            subprocess.run([compiler(), *_FLAGS, "-I", str(HEADER.parent), "-o", tmp.name, *map(str, SOURCES)],
                           check=True, capture_output=True, text=True)
            os.replace(tmp.name, path)
        finally:
            if os.path.exists(tmp.name):
                os.unlink(tmp.name)
        logger.info("built the CPU kernels into %s", path)
    return ctypes.CDLL(str(path))
