"""LoRA adapters: how many one step mixes, how large they may be, how many stay loaded."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class LoRAConfig:
    """Set when adapters are enabled (`--enable-lora`)."""

    max_loras: int = 1
    """Distinct adapters in one step: the device slots every adapted layer holds."""
    max_lora_rank: int = 16
    """Largest rank an adapter may have; every slot is this wide."""
    max_cpu_loras: int = 1
    """Adapters kept loaded in host memory (least recently used ones are dropped), at least max_loras."""
    dtype: torch.dtype = torch.float32
    """How the adapters' weights are stored and multiplied."""
