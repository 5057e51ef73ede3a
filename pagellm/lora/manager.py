"""A worker's LoRA adapters: the host copies the engine core sent, and the device slots of every
adapted layer, each holding one adapter while requests that use it live on this worker."""
from __future__ import annotations

import re
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagellm.config.lora import LoRAConfig
from pagellm.lora.adapter import TARGET_MODULES, LoRAAdapter
from pagellm.lora.batch import LoRABatch
from pagellm.lora.layers import AdaptedLinear

_ADAPTABLE = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.[a-z_]+$")


class LoRAManager:
    """Adapter slots on the model's linear layers, and which adapter each slot holds."""

    def __init__(self, model: nn.Module, config: LoRAConfig, max_rows: int, device: torch.device) -> None:
        """`max_rows`: the most rows one forward runs (the step's token budget, or a padded graph's)."""
        self.batch = LoRABatch(config.max_loras, max_rows, device)
        self.layers = _adapt(model, config, self.batch, device)
        self._decoder_layers = model.decoder_layers()
        self._adapters: dict[int, LoRAAdapter] = {}
        self._slot_ids: list[int | None] = [None] * config.max_loras
        self._slot_users = [0] * config.max_loras
        self._slot_of: dict[int, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict((s, None) for s in range(config.max_loras))
        """Slots no live request uses, the longest idle first: the next adapter takes the first."""
        self._fused: list | None = None
        """The decoder layers' fused CPU calls while a step with adapters set them aside."""
        self._fused_apply_lora = False
        """Whether the fused CPU decoder layers apply the adapters themselves (`bind_fused_layers`)."""

    def add(self, adapter: LoRAAdapter) -> None:
        """Keep an adapter the engine core loaded (its slot is filled when a request needs it)."""
        self._adapters[adapter.lora_int_id] = adapter

    def remove(self, lora_id: int) -> None:
        """Forget an adapter the engine core dropped (no live request uses it)."""
        self._adapters.pop(lora_id, None)
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            self._slot_ids[slot] = None

    def acquire(self, lora_id: int) -> int:
        """The slot of a request's adapter, filled now if no slot holds it."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            if not self._idle:
                raise RuntimeError(f"more than max_loras ({len(self._slot_ids)}) adapters are in use on this worker")
            slot = next(iter(self._idle))
            old = self._slot_ids[slot]
            if old is not None:
                del self._slot_of[old]
            adapter = self._adapters.get(lora_id)
            if adapter is None:
                raise RuntimeError(f"LoRA adapter {lora_id} was never sent to this worker")
            for layer in self.layers:
                layer.load(slot, adapter)
            self._slot_ids[slot], self._slot_of[lora_id] = lora_id, slot
        self._slot_users[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """A request that used `slot` left this worker."""
        self._slot_users[slot] -= 1
        if not self._slot_users[slot]:
            self._idle[slot] = None

    def bind_fused_layers(self) -> None:
        """Once the decoder layers are fused (CPU, after the KV cache is bound): hand them the
        slots to apply, which they do in C when the slots are float32."""
        fused = [layer.fused for layer in self._decoder_layers if layer.fused is not None]
        if not fused or any(layer.a.dtype != torch.float32 for layer in self.layers):
            return
        by_module = {layer.base: layer for layer in self.layers}
        for call in fused:
            call.attach_lora(by_module, self.batch)
        self._fused_apply_lora = True

    def prepare(self, token_slots: np.ndarray, padded_rows: int | None = None) -> None:
        """Set the next forward's rows' slots (`LoRABatch.prepare`). Fused CPU decoder layers that
        do not apply the adapters (`bind_fused_layers`) step aside for a step that uses one: the
        layers then run module by module, through the adapters' hooks."""
        self.batch.prepare(token_slots, padded_rows)
        if self._fused_apply_lora:
            return
        if self.batch.active and self._fused is None:
            self._fused = [layer.fused for layer in self._decoder_layers]
            for layer in self._decoder_layers:
                layer.fused = None
        elif not self.batch.active and self._fused is not None:
            for layer, fused in zip(self._decoder_layers, self._fused):
                layer.fused = fused
            self._fused = None


def _adapt(model: nn.Module, config: LoRAConfig, batch: LoRABatch, device: torch.device) -> list[AdaptedLinear]:
    """Slots on every linear layer of the model that an adapter may adapt (this pipeline stage's)."""
    adapted = []
    for name, module in model.named_modules():
        if not _ADAPTABLE.match(name) or not hasattr(module, "parts"):
            continue
        hf_names = [n.removesuffix(".weight") for n in model.checkpoint_names(name + ".weight")]
        if not all(n.rpartition(".")[2] in TARGET_MODULES for n in hf_names):
            continue
        offsets = tuple(first for _, first, _ in module.parts()) + (module.output_size,)
        adapted.append(AdaptedLinear(module, hf_names, offsets, config, batch, device))
    if not adapted:
        raise ValueError(f"{type(model).__name__} has no linear layer an adapter can adapt ({', '.join(TARGET_MODULES)})")
    return adapted
