"""Gated activations."""
from __future__ import annotations

import torch
from torch import nn

from pagellm import ops


class SiluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> silu(gate) * up, [..., d]; one Triton kernel on a GPU (`pagellm.ops`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
