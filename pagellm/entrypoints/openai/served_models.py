"""The names a server answers to in a request's `model`: its base model's (`--served-model-name`) and
those of the LoRA adapters it serves on it (`--lora-modules`, and /v1/load_lora_adapter at run time)."""
from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pagellm.config import EngineConfig
from pagellm.config.arch import ModelArchConfig
from pagellm.config.lora import LoRAConfig
from pagellm.lora.adapter import load_adapter
from pagellm.lora_request import LoRARequest


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What a request's `model` names."""

    name: str
    """The name responses report."""
    lora_request: LoRARequest | None = None
    """The adapter the request runs with; None: the base model."""


class UnknownModelError(LookupError):
    """A name that is neither a served model's nor a loaded adapter's."""


class ServedModels:
    """The base model's names and the adapters loaded under their own names.

    Each load gets a fresh `lora_int_id` (counting from 1, never reused), so that an adapter loaded
    again under an old name, perhaps from another path, shares no KV-cache blocks with the old one.
    Unloading only forgets the name: requests already running keep their LoRARequest and finish.
    """

    def __init__(self, base_names: Sequence[str], arch: ModelArchConfig, lora_config: LoRAConfig | None) -> None:
        if not base_names:
            raise ValueError("served_model_name must name at least one model")
        self.base_names = list(base_names)
        self._arch = arch
        self._lora_config = lora_config
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @classmethod
    def for_engine(cls, base_names: Sequence[str], config: EngineConfig) -> ServedModels:
        return cls(base_names, config.model.source.arch, config.lora)

    def __iter__(self) -> Iterator[ServedModel]:
        """The base model's names, then the adapters in the order they were loaded."""
        yield from (ServedModel(name) for name in self.base_names)
        yield from (ServedModel(name, lora) for name, lora in self._adapters.items())

    def resolve(self, model: str | None) -> ServedModel:
        """What `model` names (None: the first base name); UnknownModelError saying what is served."""
        if model is None or model in self.base_names:
            return ServedModel(model or self.base_names[0])
        lora = self._adapters.get(model)
        if lora is None:
            raise UnknownModelError(f"the model `{model}` does not exist; this server serves: {self._described()}")
        return ServedModel(model, lora)

    async def load_adapter(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Serve the PEFT adapter at `path` as `name`, once its files have been read and checked against
        the model (in a thread: reading them takes a while); a ValueError says why not."""
        if self._lora_config is None:
            raise ValueError("this server serves no LoRA adapters: start it with --enable-lora")
        self._check_free(name)
        lora = LoRARequest(name, next(self._ids), path, base_model_name)
        await asyncio.to_thread(load_adapter, lora, self._arch, self._lora_config)
        self._check_free(name)  # another load of the same name may have finished meanwhile
        self._adapters[name] = lora
        return lora

    def unload_adapter(self, name: str) -> LoRARequest:
        """Stop serving the adapter `name`; UnknownModelError if none is loaded under it."""
        lora = self._adapters.pop(name, None)
        if lora is None:
            loaded = ", ".join(self._adapters) or "none"
            raise UnknownModelError(f"no LoRA adapter `{name}` is loaded; loaded adapters: {loaded}")
        return lora

    def _check_free(self, name: str) -> None:
        if name in self.base_names:
            raise ValueError(f"`{name}` is the base model's name (--served-model-name); give the adapter another")
        if name in self._adapters:
            raise ValueError(f"a LoRA adapter named `{name}` is already loaded (from "
                             f"{self._adapters[name].lora_path}); unload it first, or choose another name")

    def _described(self) -> str:
        served = ", ".join(self.base_names)
        return f"{served}; LoRA adapters: {', '.join(self._adapters)}" if self._adapters else served
