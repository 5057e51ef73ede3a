"""Mixture-of-Experts: which experts each token goes to (`select_experts`), and the experts' MLPs
applied to the tokens routed to them (`fused_moe`).

The layout every implementation shares (`pagellm.layers.moe` holds the weights):
- `w13` [experts, 2 x intermediate, hidden]: each expert's gate rows, then its up rows;
- `w2` [experts, hidden, intermediate]: each expert's down projection;
- `topk_ids` [tokens, top_k] int32: the experts each token goes to (-1: none, as an expert held by
  another rank under expert parallelism), `topk_weights` [tokens, top_k] float32 their weights.
The output is sum over k of weight_k x down_k(silu(gate_k x) * up_k x), in x's dtype.

The torch functions here are the oracle the Triton kernels (`pagellm.ops.triton.moe`) are tested
against, and the path on the CPU.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Scoring = Literal["softmax", "sigmoid"]


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: Scoring = "softmax",
                   correction_bias: torch.Tensor | None = None, num_groups: int | None = None,
                   topk_groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32).

    `scoring`: softmax over all experts (Mixtral, Qwen-MoE) or a sigmoid per expert (DeepSeek-V3);
    `renormalize`: the k weights rescaled to sum to 1; `correction_bias` [E]: added to the scores
    for choosing experts only, not to their weights; `num_groups` / `topk_groups`: experts split in
    groups, and only the `topk_groups` groups with the best two scores each are chosen from."""
    scores = router_logits.float()
    scores = scores.softmax(dim=-1) if scoring == "softmax" else scores.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups is not None and topk_groups is not None and topk_groups < num_groups:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, num_groups, experts // num_groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(group_score).scatter_(1, group_score.topk(topk_groups, dim=-1).indices, 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(experts // num_groups, dim=1), float("-inf"))
    topk_ids = choice.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids.to(torch.int32)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H] through the experts of `topk_ids` (see the module's docstring); a loop over the
    experts that have tokens, each reading only its own weights. Accumulates in float32."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    experts, counts = torch.unique_consecutive(flat_ids[order], return_counts=True)
    start = 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        picks = order[start:start + count]
        start += count
        if expert < 0:
            continue
        rows = picks // topk_ids.shape[1]
        gate_up = F.linear(x[rows], w13[expert])
        hidden = F.silu(gate_up[:, :gate_up.shape[1] // 2]) * gate_up[:, gate_up.shape[1] // 2:]
        down = F.linear(hidden, w2[expert]).float()
        out.index_add_(0, rows, down * topk_weights.reshape(-1)[picks].unsqueeze(1))
    return out.to(x.dtype)
