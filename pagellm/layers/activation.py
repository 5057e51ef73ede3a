"""Gated activations."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm import ops


class SiluAndMul(nn.Module):
    """[..., 2d] (gate, up) -> silu(gate) * up, [..., d]; one Triton kernel on a GPU (`pagellm.ops`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    """[..., 2d] (gate, up) -> gelu(gate) * up with GELU's tanh approximation (`gelu_pytorch_tanh`), [..., d]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
