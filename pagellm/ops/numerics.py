"""Numeric constants the kernels and the quantization methods share."""
from __future__ import annotations

from typing import Literal

import torch

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
"""The largest magnitude of each 8-bit type (what a row's largest value is scaled to)."""

MoEActivation = Literal["silu", "swigluoai"]
MOE_ACTIVATIONS: tuple[MoEActivation, ...] = ("silu", "swigluoai")
"""A mixture of experts' activations (`pagellm.ops.moe`), by the index the Triton kernel takes."""
SWIGLUOAI_ALPHA = 1.702
"""GPT-OSS's SwiGLU: the gate's sigmoid is of alpha x gate (its config's `swiglu_alpha`)."""
SWIGLUOAI_LIMIT = 7.0
"""GPT-OSS's SwiGLU: the gate is clamped from above, and up from both sides, at this (`swiglu_limit`)."""
