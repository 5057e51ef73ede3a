"""Which LoRA adapter a request runs with, as vLLM's `LoRARequest`. Pure Python (no torch)."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True):
    """A PEFT adapter (a folder with adapter_config.json and adapter_model.safetensors or .bin)
    applied to the base model for one request: `LoRARequest("sql", 1, "/adapters/sql")`.

    `lora_int_id` names the adapter inside the engine (its KV-cache blocks, its device slot): two
    requests with the same id must give the same path.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None
    """The model the adapter was trained on, as the server's /v1/models reports it (informative)."""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")
