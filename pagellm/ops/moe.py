"""Mixture-of-Experts: which experts each token goes to (`select_experts`), and the experts' MLPs
applied to the tokens routed to them (`fused_moe`).

The layout every implementation shares (`pagellm.layers.moe` holds the weights):
- `w13` [experts, 2 x intermediate, hidden]: each expert's gate rows, then its up rows;
- `w2` [experts, hidden, intermediate]: each expert's down projection;
- `topk_ids` [tokens, top_k] int32: the experts each token goes to (-1: none, as an expert held by
  another rank under expert parallelism), `topk_weights` [tokens, top_k] float32 their weights.
- optional biases (GPT-OSS's experts have them): `w13_bias` [experts, 2 x intermediate] (gate's,
  then up's) added to the gate/up product, `w2_bias` [experts, hidden] to the down product.
The output is sum over k of weight_k x (down_k(act(gate_k x + b_gate, up_k x + b_up)) + b_down), in
x's dtype, `act` the `activation`: "silu", silu(gate) * up (Llama's MLP); "swigluoai", GPT-OSS's
clamped SwiGLU, (up' + 1) x gate' x sigmoid(1.702 gate') with gate' = min(gate, 7) and up' = up
clamped to [-7, 7].

`fused_moe` runs the Triton kernels (`pagellm.ops.triton.moe`) on a GPU and the torch oracle here,
`fused_moe_ref`, on the CPU; the kernels are tested against it.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from pagellm.ops.dispatch import Impl, resolve_impl
from pagellm.ops.numerics import MOE_ACTIVATIONS, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, MoEActivation

Scoring = Literal["softmax", "sigmoid", "topk_softmax"]
MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The activations' and experts' dtypes `fused_moe` takes."""


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool, scoring: Scoring = "softmax",
                   correction_bias: torch.Tensor | None = None, num_groups: int | None = None,
                   topk_groups: int | None = None, impl: Impl | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32).

    `scoring`: softmax over all experts (Mixtral, Qwen-MoE), a sigmoid per expert (DeepSeek-V3), or
    "topk_softmax": the k largest logits, their weights a softmax over those k alone (GPT-OSS; the
    same weights as a renormalized softmax, computed without the other experts' exponentials, and
    the choice made on the logits, where a softmax that underflows cannot tie them);
    `renormalize`: the k weights rescaled to sum to 1 (they already do with topk_softmax);
    `correction_bias` [E]: added to the scores for choosing experts only, not to their weights;
    `num_groups` / `topk_groups`: experts split in groups, and only the `topk_groups` groups with
    the best two scores each are chosen from.

    On a GPU (`pagellm.ops.dispatch`) the softmax and topk_softmax scorings without bias or groups
    run as one Triton kernel (`pagellm.ops.triton.routing`); the rest, and the CPU, here."""
    if resolve_impl(router_logits, impl) == "triton":
        from pagellm.ops.triton import routing

        if routing.supports(top_k, router_logits.shape[-1], scoring, correction_bias, num_groups):
            return routing.select_experts(router_logits, top_k, renormalize, scoring)
    scores = router_logits.float()
    if scoring == "topk_softmax":
        if correction_bias is not None or num_groups is not None:
            raise ValueError("scoring topk_softmax takes no correction_bias nor expert groups")
        top = scores.topk(top_k, dim=-1)
        return top.values.softmax(dim=-1), top.indices.to(torch.int32)
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
                  topk_ids: torch.Tensor, *, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: MoEActivation = "silu") -> torch.Tensor:
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
        gate_up = F.linear(x[rows], w13[expert], None if w13_bias is None else w13_bias[expert])
        hidden = activate(gate_up, activation)
        down = F.linear(hidden, w2[expert], None if w2_bias is None else w2_bias[expert]).float()
        out.index_add_(0, rows, down * topk_weights.reshape(-1)[picks].unsqueeze(1))
    return out.to(x.dtype)


def activate(gate_up: torch.Tensor, activation: MoEActivation) -> torch.Tensor:
    """[N, 2 x I] (gate, then up) -> [N, I] through `activation` (the module's docstring)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    return (up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT) + 1) * gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, impl: Impl | None = None, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: MoEActivation = "silu") -> torch.Tensor:
    """x [T, H] through the experts of `topk_ids` (see the module's docstring) -> [T, H] in x's dtype:
    the Triton kernels for GPU tensors, `fused_moe_ref` elsewhere (`pagellm.ops.dispatch`).

    An id must be -1 or an expert of w13 (a pair of id -1 adds nothing, its expert's biases
    included). The CPU checks; the GPU path, which would have to wait for the device to check,
    treats any id outside 0 .. E - 1 as -1."""
    check_moe_inputs(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, activation)
    if resolve_impl(x, impl) == "triton":
        from pagellm.ops.triton import moe as triton_moe

        return triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids, w13_bias=w13_bias, w2_bias=w2_bias,
                                    activation=activation)
    if not topk_ids.is_cuda and topk_ids.numel():
        low, high = topk_ids.min().item(), topk_ids.max().item()
        if low < -1 or high >= w13.shape[0]:
            raise ValueError(f"topk_ids must be -1 or an expert of 0 to {w13.shape[0] - 1}, got {low} to {high}")
    return fused_moe_ref(x, w13, w2, topk_weights, topk_ids, w13_bias=w13_bias, w2_bias=w2_bias,
                         activation=activation)


def check_moe_inputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     activation: str = "silu") -> None:
    """ValueError naming the argument whose shape, dtype or value disagrees with the layout."""
    if activation not in MOE_ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(MOE_ACTIVATIONS)}, not {activation!r}")
    if x.dim() != 2 or x.dtype not in MOE_DTYPES:
        raise ValueError(f"x must be [tokens, hidden] of {', '.join(map(str, MOE_DTYPES))}, not {x.dtype} "
                         f"{tuple(x.shape)}")
    tokens, hidden = x.shape
    if w13.dim() != 3 or w13.shape[1] % 2 or w13.shape[2] != hidden:
        raise ValueError(f"w13 must be [experts, 2 x intermediate, hidden={hidden}], not {tuple(w13.shape)}")
    experts, inter = w13.shape[0], w13.shape[1] // 2
    if w2.shape != (experts, hidden, inter):
        raise ValueError(f"w2 must be [experts={experts}, hidden={hidden}, intermediate={inter}], "
                         f"not {tuple(w2.shape)}")
    biases = {name: (b, shape) for name, b, shape in (("w13_bias", w13_bias, (experts, 2 * inter)),
                                                      ("w2_bias", w2_bias, (experts, hidden))) if b is not None}
    for name, (b, shape) in biases.items():
        if b.shape != shape:
            raise ValueError(f"{name} must be [{', '.join(map(str, shape))}], not {tuple(b.shape)}")
    for name, w in (("w13", w13), ("w2", w2), *((name, b) for name, (b, _) in biases.items())):
        if w.dtype != x.dtype:
            raise ValueError(f"{name} must be x's dtype {x.dtype}, not {w.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 [tokens={tokens}, top_k], not {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be float [{tokens}, {topk_ids.shape[1]}] as topk_ids, not "
                         f"{topk_weights.dtype} {tuple(topk_weights.shape)}")
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids, *(b for b, _ in biases.values()))}
    if len(devices) > 1:
        raise ValueError(f"x, w13, w2, topk_weights, topk_ids and the biases must be on one device, not "
                         f"{sorted(map(str, devices))}")
