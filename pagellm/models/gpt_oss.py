"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): Llama's decoder layer with biased q/k/v/o projections, a
learned sink logit per attention head, sliding-window (`layer_types`) and full layers alternating,
YaRN rotary scaling, and a mixture of experts in every layer.

The MoE block: a biased router picks each token's top-k experts by their logits, weighted by a
softmax over those k ("topk_softmax"); the experts have biases and GPT-OSS's clamped SwiGLU
("swigluoai"). transformers' checkpoints stack every expert's projections in 3-D tensors kept
transposed, `experts.gate_up_proj` [experts, hidden, 2 x intermediate] (gate and up columns
interleaved) and `experts.down_proj` [experts, intermediate, hidden]; they are transposed back at
load. The MXFP4 checkpoints OpenAI publishes reach the model already dequantized, in that same
layout (`pagellm.loader.mxfp4`).
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.config.arch import ModelArchConfig
from pagellm.distributed import tensor_parallel_all_reduce
from pagellm.layers import ReplicatedLinear
from pagellm.layers.moe import STACKED, FusedMoE
from pagellm.models.llama import LlamaAttention, LlamaForCausalLM
from pagellm.ops.numerics import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT

_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias)?$")
"""A checkpoint's stacked expert tensors: model.layers.0.mlp.experts.gate_up_proj, ...down_proj_bias."""
_EXPERT_PARAM = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(w13|w2)_(weight|bias)$")
_PARTS = {"gate_up_proj": ("w13", "w13_interleaved"), "down_proj": ("w2", "w2")}
"""Checkpoint projection -> (FusedMoE parameter, the weight loader's part)."""
_SINKS = re.compile(r"^(model\.layers\.\d+\.self_attn)\.sinks$")
_SINKS_PARAM = re.compile(r"^(model\.layers\.\d+\.self_attn)\.attn\.sinks$")


class GptOssAttention(LlamaAttention):
    """Llama's attention (biases per `attention_bias`, true in GPT-OSS's configs) with a sink logit
    per head (the `Attention` layer's `sinks`)."""

    attention_sinks = True


class GptOssMoE(nn.Module):
    """A token's MLP output: its top-k experts' outputs, weighted by a softmax over their router
    logits. One all-reduce sums the ranks' partial results."""

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        hf = config.hf_config
        for key, value in (("swiglu_alpha", SWIGLUOAI_ALPHA), ("swiglu_limit", SWIGLUOAI_LIMIT)):
            if hf.get(key, value) != value:
                raise ValueError(f"config.json's {key} is {hf[key]!r}: pagellm's GPT-OSS experts compute the "
                                 f"clamped SwiGLU of {key} {value} only")
        self.router = ReplicatedLinear(config.hidden_size, config.num_experts, bias=True)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=False, scoring="topk_softmax",
                                activation="swigluoai", bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_parallel_all_reduce(self.experts(x, self.router(x)))


class GptOssForCausalLM(LlamaForCausalLM):
    attention_cls = GptOssAttention

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        if not config.num_experts:
            raise ValueError(f"{type(self).__name__} needs num_local_experts in config.json")
        super().__init__(config, attn_backend)

    def mlp_for_layer(self, config: ModelArchConfig, index: int) -> nn.Module:
        return GptOssMoE(config)

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        sinks = _SINKS.match(name)
        if sinks is not None:
            return f"{sinks.group(1)}.attn.sinks", None
        experts = _EXPERTS.match(name)
        if experts is not None:
            prefix, projection, bias = experts.groups()
            param, part = _PARTS[projection]
            return f"{prefix}.{param}_{'bias' if bias else 'weight'}", (STACKED, part)
        return super().checkpoint_target(name)

    def checkpoint_parts(self, param_name: str) -> dict[object, str]:
        sinks = _SINKS_PARAM.match(param_name)
        if sinks is not None:
            return {None: f"{sinks.group(1)}.sinks"}
        expert_param = _EXPERT_PARAM.match(param_name)
        if expert_param is not None:
            prefix, param, kind = expert_param.groups()
            projection = "gate_up_proj" if param == "w13" else "down_proj"
            name = f"{prefix}.{projection}{'_bias' if kind == 'bias' else ''}"
            parts = ("w1", "w3") if param == "w13" else ("w2",)
            return {(e, part): name for e in self._experts(param_name).local_experts() for part in parts}
        return super().checkpoint_parts(param_name)

    def shards_filled(self, target: str, shard_id: object) -> set:
        if _EXPERT_PARAM.match(target):
            return self._experts(target).shards_filled(shard_id)
        return super().shards_filled(target, shard_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # The stacked projections as FusedMoE loads them, [experts, out, in] (see the module's docstring).
        return super().load_weights(
            (name, tensor.transpose(-1, -2) if _is_expert_weight(name) else tensor) for name, tensor in weights)

    def _experts(self, param_name: str) -> FusedMoE:
        return self.get_submodule(param_name.rpartition(".")[0])


def _is_expert_weight(name: str) -> bool:
    """Whether checkpoint tensor `name` is a stacked expert projection (not its bias)."""
    experts = _EXPERTS.match(name)
    return experts is not None and experts.group(3) is None
