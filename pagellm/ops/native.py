"""C kernels for the CPU, compiled on first use with the system C compiler and cached per user.

A library is built once per source text and flags (about a second) into ~/.cache/pagellm (or
$XDG_CACHE_HOME/pagellm), then loaded with ctypes. Loaded after torch, its OpenMP dependency
resolves to the libgomp torch already loaded: one thread pool for both. Callers check
`unavailable_reason()` and fall back to PyTorch where it is not None.
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

_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")


def unavailable_reason(source: Path) -> str | None:
    """Why the kernels of `source` cannot run here (None: they can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the CPU kernels need an x86-64 CPU, this is {platform.machine()}"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU kernels need AVX2 and FMA, which this CPU lacks"
    if compiler() is None:
        return "no C compiler (cc, gcc or $CC) was found to build the CPU kernels"
    try:
        load(source)
    except subprocess.CalledProcessError as e:
        return f"building {source.name} failed: {e.stderr.strip()[-500:]}"
    except OSError as e:
        return f"building or loading {source.name} failed: {e}"
    return None


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def load(source: Path) -> ctypes.CDLL:
    """The compiled library of `source` (built now if this text and flags were never built)."""
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join(_FLAGS).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagellm"
    path = cache / f"{source.stem}-{key}.so"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: concurrent processes never load a half-written file.
        with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
            pass
        try:
            subprocess.run([compiler(), *_FLAGS, "-o", tmp.name, str(source)], check=True, capture_output=True,
                           text=True)
            os.replace(tmp.name, path)
        finally:
            if os.path.exists(tmp.name):
                os.unlink(tmp.name)
        logger.info("built %s into %s", source.name, path)
    return ctypes.CDLL(str(path))
