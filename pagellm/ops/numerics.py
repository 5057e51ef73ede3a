"""Numeric constants the kernels and the quantization methods share."""
from __future__ import annotations

import torch

QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
"""The largest magnitude of each 8-bit type (what a row's largest value is scaled to)."""
