"""Launch helpers shared by the Triton kernel wrappers."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagellm.ops.dispatch import triton_interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: no PDL (`pdl` asks for none)
    gdc_launch_dependents = gdc_wait = None


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dimension is dense (kernels take the other strides as arguments), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def num_warps_for(block: int) -> int:
    """Warps for a program that owns `block` elements: about 256 elements a warp, 1 to 16 warps.

    A batch-1 decode step launches a single program per row op, so wide rows need many warps to
    keep the reduction short.
    """
    return min(max(block // 256, 1), 16)


def pdl(device: torch.device) -> dict:
    """Launch options for a kernel that takes a `PDL` constexpr and starts with `pdl_start` (or
    its two halves): on Hopper and later GPUs, programmatic dependent launch, so that the kernel's
    programs are placed while the kernel before it finishes and its start-up (and whatever it reads
    that no earlier kernel writes, e.g. a weight) overlaps that kernel's tail. A one-row step of a
    large model is some 300 launches of a few microseconds each. Elsewhere nothing: the CPU
    interpreter (also with CUDA tensors), older or AMD GPUs, a Triton without it."""
    return {} if device.type != "cuda" else _pdl_options(device.index)


@functools.cache
def _pdl_options(index: int | None) -> dict:
    """Decided once a device (Triton itself reads TRITON_INTERPRET when a kernel is defined)."""
    if gdc_wait is None or torch.version.hip or triton_interpreting():
        return {}
    major, _ = torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if major >= 9 else {}


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel's programs be placed (once every program of this one has said so)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Wait until the kernel before has finished and its writes are visible: before any program
    reads what an earlier kernel wrote, writes anything, or returns (a kernel that ends before the
    one it follows would let the next read too early)."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """`pdl_release` then `pdl_wait`: for a kernel with nothing to read ahead."""
    pdl_release(PDL)
    pdl_wait(PDL)


@triton.jit
def dot_f32(a, b, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b summed in float32; float32 inputs exactly (IEEE, not TF32). Triton's interpreter multiplies
    bfloat16 tensors as the integers that hold their bits: there the same values' products in float32
    (exact, as the tensor cores')."""
    if INTERPRET:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32))
    elif IEEE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out
