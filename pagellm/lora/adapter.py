"""A LoRA adapter in PEFT's format, read from its folder and checked against the base model.

PEFT saves `adapter_config.json` (rank `r`, `lora_alpha`, `use_rslora`, `target_modules`, ...) and
`adapter_model.safetensors` (or `.bin`) with one A [r, in] and one B [out, r] per adapted linear
layer, named `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`. Adapted layers add
(x A^T) B^T x scaling, scaling = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)); the scaling is folded
into B here.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

from pagellm.config.arch import ModelArchConfig
from pagellm.config.lora import LoRAConfig
from pagellm.lora_request import LoRARequest

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers an adapter may adapt (Hugging Face names), in every decoder layer."""

_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+))"
                  r"\.lora_([AB])\.weight$")
_MOE_KEY = re.compile(r"\.(?:block_sparse_moe|experts|shared_expert|shared_expert_gate)\."
                      r"|\.mlp\.(?:gate|router)\.lora_")
"""A tensor adapting part of a mixture-of-experts block: an expert, the router or the shared expert."""
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
_UNSUPPORTED_CONFIG = {
    "use_dora": "DoRA (use_dora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "modules_to_save": "modules_to_save (whole embedding or LM-head copies)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served: its files are missing or malformed, or it does not fit the
    base model or the engine's limits."""


@dataclass(slots=True)
class LoRAAdapter:
    """An adapter's weights in host memory, ready to be copied into device slots."""

    request: LoRARequest
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Hugging Face module name ("model.layers.0.self_attn.q_proj") -> (A [r, in], B x scaling [out, r])."""

    @property
    def lora_int_id(self) -> int:
        return self.request.lora_int_id

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable module of a decoder layer."""
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_adapter(request: LoRARequest, arch: ModelArchConfig, config: LoRAConfig) -> LoRAAdapter:
    """Read and check the adapter at `request.lora_path`; LoRAAdapterError says what is wrong."""
    where = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    try:
        peft_config = _read_config(request.lora_path)
        rank, scaling = _scaling(peft_config)
        tensors = _read_tensors(request.lora_path)
        weights = _pair_up(tensors, rank, scaling, arch, config)
    except LoRAAdapterError as e:
        raise LoRAAdapterError(f"{where}: {e}") from None
    if rank > config.max_lora_rank:
        raise LoRAAdapterError(f"{where}: rank {rank} is larger than max_lora_rank (--max-lora-rank) "
                               f"{config.max_lora_rank}")
    return LoRAAdapter(request, rank, weights)


def _read_config(folder: str) -> dict:
    path = os.path.join(folder, "adapter_config.json")
    if not os.path.isfile(path):
        if os.path.isdir(folder):
            raise LoRAAdapterError(f"no adapter_config.json in {folder!r}")
        raise LoRAAdapterError("is not a folder" if os.path.exists(folder) else "the folder does not exist")
    try:
        with open(path) as f:
            peft_config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(peft_config, dict):
        raise LoRAAdapterError("adapter_config.json must hold a JSON object")
    peft_type = peft_config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAAdapterError(f"peft_type is {peft_type!r}; only LORA adapters are served")
    for key, what in _UNSUPPORTED_CONFIG.items():
        if peft_config.get(key):
            raise LoRAAdapterError(f"{what} is not supported")
    if peft_config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"bias {peft_config['bias']!r} is not supported; only 'none'")
    return peft_config


def _scaling(peft_config: dict) -> tuple[int, float]:
    rank, alpha = peft_config.get("r"), peft_config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoRAAdapterError(f"adapter_config.json's r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoRAAdapterError(f"adapter_config.json's lora_alpha must be a number, got {alpha!r}")
    return rank, alpha / (math.sqrt(rank) if peft_config.get("use_rslora") else rank)


def _read_tensors(folder: str) -> dict[str, torch.Tensor]:
    safetensors = os.path.join(folder, "adapter_model.safetensors")
    pickled = os.path.join(folder, "adapter_model.bin")
    try:
        if os.path.isfile(safetensors):
            return load_file(safetensors)
        if os.path.isfile(pickled):
            return torch.load(pickled, map_location="cpu", weights_only=True)
    except Exception as e:
        raise LoRAAdapterError(f"its weights could not be read: {type(e).__name__}: {e}") from None
    raise LoRAAdapterError("no adapter_model.safetensors or adapter_model.bin")


def _pair_up(tensors: dict[str, torch.Tensor], rank: int, scaling: float, arch: ModelArchConfig,
             config: LoRAConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """(A, B x scaling) per module, each checked against the model's shapes."""
    shapes = module_shapes(arch)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if _MOE_KEY.search(key):
            raise LoRAAdapterError(f"tensor {key!r} adapts part of a mixture-of-experts block (an expert, the router "
                                   "or the shared expert), which adapters cannot adapt yet; adapters of the attention "
                                   "projections (q_proj, k_proj, v_proj, o_proj) are served")
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"tensor {key!r} adapts no linear layer of a decoder layer: only "
                                   f"{', '.join(TARGET_MODULES)} are supported")
        module, layer, name, half = match.groups()
        if name not in shapes:
            raise LoRAAdapterError(f"tensor {key!r}: {name} is not an adaptable module ({', '.join(TARGET_MODULES)})")
        if int(layer) >= arch.num_hidden_layers:
            raise LoRAAdapterError(f"tensor {key!r}: the base model has {arch.num_hidden_layers} layers")
        if name in _MLP_MODULES and arch.is_moe_layer(int(layer)):
            raise LoRAAdapterError(f"tensor {key!r}: layer {layer}'s MLP is a mixture of experts, which adapters "
                                   "cannot adapt yet; adapters of the attention projections are served")
        halves.setdefault(module, {})[half] = tensor
    if not halves:
        raise LoRAAdapterError("its weights hold no LoRA tensors")
    weights = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"{module} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module.rpartition(".")[2]]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise LoRAAdapterError(
                f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base model's "
                f"layer ({fan_in} in, {fan_out} out) at rank {rank}: was it trained on another model?")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAAdapterError(f"{module}: lora_A and lora_B must be floating-point tensors")
        weights[module] = (a.to(config.dtype).contiguous(), (b.float() * scaling).to(config.dtype).contiguous())
    return weights
