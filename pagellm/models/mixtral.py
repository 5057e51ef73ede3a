"""Mixtral: Llama whose every MLP is eight experts, two per token, their weights renormalized
(checkpoints: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2`)."""
from __future__ import annotations

from pagellm.config.arch import ModelArchConfig
from pagellm.models.moe import MoECausalLM


class MixtralForCausalLM(MoECausalLM):
    moe_checkpoint_block = "block_sparse_moe"
    expert_checkpoint_names = ("w1", "w3", "w2")

    def renormalize(self, config: ModelArchConfig) -> bool:
        return True
