"""Where pagellm keeps what it builds or measures once per machine, so later starts skip it: the
CPU kernels, Triton's compiled GPU kernels and autotuning results, and the per-shape kernel
choices timed at start-up (`pagellm.ops.choice_cache`).

One folder holds all of it, so a Docker image or a copied folder carries it to another machine of
the same GPU kind (`pagellm warmup` fills it). As vLLM's VLLM_CACHE_ROOT: `PAGELLM_CACHE_ROOT`,
else `$XDG_CACHE_HOME/pagellm`, else `~/.cache/pagellm`.
"""
from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

CACHE_ROOT_ENV = "PAGELLM_CACHE_ROOT"
TRITON_CACHE_ENV = "TRITON_CACHE_DIR"
"""Triton's own variable: where it keeps compiled kernels (and, for autotuned kernels that ask for
it, their timed choices)."""


def cache_root(environ: MutableMapping[str, str] = os.environ) -> Path:
    """The cache folder (not created here)."""
    if environ.get(CACHE_ROOT_ENV):
        return Path(environ[CACHE_ROOT_ENV]).expanduser()
    base = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "pagellm"


def use_cache_for_triton(environ: MutableMapping[str, str] = os.environ) -> Path:
    """Point Triton's compile cache at `<cache root>/triton`, unless the user set TRITON_CACHE_DIR
    (theirs wins); returns the folder Triton uses. Called before the first kernel compiles: Triton
    reads the variable at each compile, and spawned rank processes inherit it."""
    if not environ.get(TRITON_CACHE_ENV):
        environ[TRITON_CACHE_ENV] = str(cache_root(environ) / "triton")
    return Path(environ[TRITON_CACHE_ENV])
