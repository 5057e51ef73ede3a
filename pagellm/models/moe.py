"""Mixture-of-experts decoder models shaped like Llama: a layer's MLP is a router, routed experts
and optionally a shared expert (`MoEBlock`), and checkpoints name every expert's projections."""
from __future__ import annotations

import re

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.config.arch import ModelArchConfig
from pagellm.distributed import tensor_parallel_all_reduce
from pagellm.layers import ReplicatedLinear
from pagellm.layers.moe import EXPERT_PARTS, STACKED, FusedMoE
from pagellm.models.llama import LlamaForCausalLM, LlamaMLP, check_silu

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.([a-z0-9_]+)\.weight$")
"""One expert's projection, e.g. model.layers.0.mlp.experts.3.gate_proj.weight."""
_STACKED_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)"
                              r"(?:\.weight)?$")
"""Every expert's projections stacked in a 3-D tensor: transformers v5's gate_up_proj [experts, 2 x
intermediate, hidden] and down_proj, or a GGUF file's gate, up and down projections apart."""
_STACKED_PARTS = {"gate_up_proj": "w13", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_PARAM = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(w13|w2)_weight$")
_MLP_PARAM = re.compile(r"^model\.layers\.(\d+)\.mlp\.")


class MoEBlock(nn.Module):
    """A token's MLP output: the weighted sum of its top-k experts' (chosen by the router, `gate`),
    plus a shared expert's scaled by sigmoid(`shared_expert_gate`) where the model has one. One
    all-reduce sums the ranks' partial results of both."""

    def __init__(self, config: ModelArchConfig, renormalize: bool, shared_expert: bool) -> None:
        super().__init__()
        check_silu(config)
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize)
        shared = config.shared_expert_intermediate_size if shared_expert else 0
        self.shared_expert = LlamaMLP(config, shared, reduce_results=False) if shared else None
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return tensor_parallel_all_reduce(out)


class MoECausalLM(LlamaForCausalLM):
    """Llama whose MoE layers (`ModelArchConfig.is_moe_layer`) have an `MoEBlock` as their MLP,
    loading experts from one tensor per expert and projection or from 3-D stacked ones.

    Subclasses say how their checkpoints name the block and the experts' projections, whether the
    chosen experts' weights are renormalized, and whether the family has a shared expert.
    """

    moe_checkpoint_block = "mlp"
    """What checkpoints call an MoE layer's block (the module is `mlp` here, as in transformers v5)."""
    expert_checkpoint_names = ("gate_proj", "up_proj", "down_proj")
    """One expert's gate, up and down projections as checkpoints name them."""
    has_shared_expert = False
    """Whether MoE layers have a gated shared expert (of `shared_expert_intermediate_size`)."""

    def __init__(self, config: ModelArchConfig, attn_backend: AttentionBackend) -> None:
        if not config.num_experts:
            raise ValueError(f"{type(self).__name__} needs num_experts (num_local_experts) in config.json")
        super().__init__(config, attn_backend)

    def renormalize(self, config: ModelArchConfig) -> bool:
        """Whether the chosen experts' weights are rescaled to sum to 1 (`norm_topk_prob`)."""
        return bool(config.norm_topk_prob)

    def mlp_for_layer(self, config: ModelArchConfig, index: int) -> nn.Module:
        if not config.is_moe_layer(index):
            return LlamaMLP(config)
        return MoEBlock(config, self.renormalize(config), self.has_shared_expert)

    def _block_name(self, name: str) -> str:
        """`name` with the checkpoint's name of the MoE block made the module's."""
        return name.replace(f".{self.moe_checkpoint_block}.", ".mlp.")

    def checkpoint_target(self, name: str) -> tuple[str, object]:
        name = self._block_name(name)
        expert = _EXPERT.match(name)
        if expert is not None and expert.group(3) in self.expert_checkpoint_names:
            prefix, index, proj = expert.groups()
            part = EXPERT_PARTS[self.expert_checkpoint_names.index(proj)]
            return f"{prefix}.{'w2' if part == 'w2' else 'w13'}_weight", (int(index), part)
        stacked = _STACKED_EXPERTS.match(name)
        if stacked is not None:
            part = _STACKED_PARTS[stacked.group(2)]
            return f"{stacked.group(1)}.{'w2' if part == 'w2' else 'w13'}_weight", (STACKED, part)
        return super().checkpoint_target(name)

    def checkpoint_parts(self, param_name: str) -> dict[object, str]:
        expert_param = _EXPERT_PARAM.match(param_name)
        if expert_param is not None:
            prefix, kind = expert_param.groups()
            prefix = prefix.replace(".mlp.", f".{self.moe_checkpoint_block}.")
            parts = ("w1", "w3") if kind == "w13" else ("w2",)
            return {(e, part): f"{prefix}.{e}.{self.expert_checkpoint_names[EXPERT_PARTS.index(part)]}.weight"
                    for e in self._experts(param_name).local_experts() for part in parts}
        parts = super().checkpoint_parts(param_name)
        layer = _MLP_PARAM.match(param_name)
        if layer is not None and self.config.is_moe_layer(int(layer.group(1))):
            return {shard: name.replace(".mlp.", f".{self.moe_checkpoint_block}.") for shard, name in parts.items()}
        return parts

    def shards_filled(self, target: str, shard_id: object) -> set:
        if _EXPERT_PARAM.match(target):
            return self._experts(target).shards_filled(shard_id)
        return super().shards_filled(target, shard_id)

    def _experts(self, param_name: str) -> FusedMoE:
        return self.get_submodule(param_name.rpartition(".")[0])
