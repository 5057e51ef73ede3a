"""Adapter slots on a linear layer: its output gains each row's adapter, through a forward hook.

A hook, not a wrapper module: the layer stays what quantization, the fused CPU decoder layer and
the weight loaders know, and a step without adapters runs it untouched. A fused layer (q/k/v,
gate/up) keeps one A block and one B block per part, in the layout of `pagellm.ops.lora`.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.config.lora import LoRAConfig
from pagellm.lora.adapter import LoRAAdapter
from pagellm.lora.batch import LoRABatch


class AdaptedLinear:
    """`max_loras` adapter slots of one linear layer, added to its output by a forward hook."""

    def __init__(self, base: nn.Module, module_names: list[str], part_offsets: tuple[int, ...], config: LoRAConfig,
                 batch: LoRABatch, device: torch.device) -> None:
        """`module_names`: the Hugging Face name of each part, in output order; `part_offsets`: the
        parts' output offsets (parts + 1 ints, from 0 to the layer's output size)."""
        self.base = base
        self.module_names = module_names
        self.part_offsets = part_offsets
        self.rank = config.max_lora_rank
        self.batch = batch
        num_parts = len(module_names)
        self.a = torch.zeros((config.max_loras, num_parts * self.rank, base.input_size), dtype=config.dtype,
                             device=device)
        self.b = torch.zeros((config.max_loras, base.output_size, self.rank), dtype=config.dtype, device=device)
        self._ranks = [0] * config.max_loras
        """The adapter rank in each slot (0: empty, or the adapter leaves this layer alone)."""
        self._parts: list[list[int]] = [[] for _ in range(config.max_loras)]
        """The parts each slot's adapter adapts."""
        base.register_forward_hook(self._hook)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Put the adapter's weights for this layer in `slot` (zeros where it adapts no part)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        parts = []
        for p, name in enumerate(self.module_names):
            pair = adapter.weights.get(name)
            if pair is None:
                continue
            a, b = pair
            r = a.shape[0]
            self.a[slot, p * self.rank:p * self.rank + r].copy_(a)
            self.b[slot, self.part_offsets[p]:self.part_offsets[p + 1], :r].copy_(b)
            parts.append(p)
        self._ranks[slot] = adapter.rank if parts else 0
        self._parts[slot] = parts

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        if not batch.active:
            return output
        x = args[0]
        if batch.uses_kernels:
            batch.add_with_kernels(output, x, self.a, self.b, self.part_offsets)
            return output
        for slot, rows in batch.groups:
            rank = self._ranks[slot]
            if not rank:
                continue
            h = x[rows].to(self.a.dtype) @ self.a[slot].t()
            for p in self._parts[slot]:
                lo, hi = self.part_offsets[p], self.part_offsets[p + 1]
                delta = h[:, p * self.rank:p * self.rank + rank] @ self.b[slot, lo:hi, :rank].t()
                output[rows, lo:hi] += delta.to(output.dtype)
        return output
