"""Which implementation an op runs: PyTorch (the test oracle), a fused Triton kernel (GPU), or a C
kernel (float32 on the CPU)."""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Literal, get_args

import torch

from pagellm.ops.c import cpu_ops

Impl = Literal["torch", "triton", "cpu"]
IMPLS: tuple[str, ...] = get_args(Impl)

# Set only inside `use_impl`; a ContextVar rather than a module global so that concurrent
# threads or tasks never see each other's override.
_forced_impl: ContextVar[Impl | None] = ContextVar("pagellm_forced_impl", default=None)


@functools.cache
def triton_available() -> bool:
    """Whether `triton` can be imported (it is optional: the CPU engine never needs it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_interpreting() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter (TRITON_INTERPRET, read as Triton
    reads it: "1", "true", "on" ...)."""
    if not triton_available():
        return False
    import triton  # noqa: PLC0415

    knobs = getattr(triton, "knobs", None)  # Triton 3.4 and later
    return bool(knobs.runtime.interpret) if knobs is not None else os.environ.get("TRITON_INTERPRET") == "1"


def _check(impl: str) -> Impl:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    return impl  # type: ignore[return-value]


@contextlib.contextmanager
def use_impl(impl: Impl) -> Iterator[None]:
    """Run every op called inside the block with `impl`, wherever its tensors are.

    Tests use it to run a whole model through the Triton kernels on the CPU (under Triton's
    interpreter) and compare it with the PyTorch path.
    """
    token = _forced_impl.set(_check(impl))
    try:
        yield
    finally:
        _forced_impl.reset(token)


def resolve_impl(x: torch.Tensor, impl: Impl | None) -> Impl:
    """`impl` if given, else the `use_impl` override, else Triton for GPU tensors when it imports,
    the C kernels for float32 CPU tensors when they build, PyTorch otherwise."""
    if impl is not None:
        return _check(impl)
    forced = _forced_impl.get()
    if forced is not None:
        return forced
    if x.is_cuda:
        return "triton" if triton_available() else "torch"
    return "cpu" if x.dtype == torch.float32 and x.device.type == "cpu" and cpu_kernels_available() else "torch"


def cpu_kernels_available() -> bool:
    """Whether the C kernels build and load here (the first call builds them: it runs the compiler)."""
    return cpu_ops.available()
