"""Launch helpers shared by the Triton kernel wrappers."""
from __future__ import annotations

import torch


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dimension is dense (kernels take the other strides as arguments), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def num_warps_for(block: int) -> int:
    """Warps for a program that owns `block` elements: about 256 elements a warp, 1 to 16 warps.

    A batch-1 decode step launches a single program per row op, so wide rows need many warps to
    keep the reduction short.
    """
    return min(max(block // 256, 1), 16)
