"""A mixture of experts' routing in one Triton launch: router logits -> each token's top-k experts
and their weights (`pagellm.ops.moe.select_experts`'s softmax and topk_softmax scorings).

The torch path takes a cast, a softmax, a top-k, a gather, a sum and a division: six or seven small
kernels a layer, each costing its launch and its fixed time, which at decode outweigh the work
(a row of 8 to 128 logits a token). Here a program takes one token's row whole: the scores in
float32, the k largest chosen one at a time (an argmax, then that expert masked out: ties go to
the lower expert id), and the weights, renormalized where asked.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORINGS = ("softmax", "topk_softmax")
"""The scorings this kernel computes; the others run in torch."""
MAX_EXPERTS = 1024
"""The most experts a program's row holds (registers)."""


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr,  # logits [T, E] (any float dtype), weights [T, K] float32, ids [T, K] int32
    E, stride_lt,
    TOP_K: tl.constexpr, E_PAD: tl.constexpr,
    TOPK_SOFTMAX: tl.constexpr,  # choose on the logits, weights a softmax over the k chosen
    RENORMALIZE: tl.constexpr,  # softmax scoring: the k weights rescaled to sum to 1
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, E_PAD)
    valid = cols < E
    logits = tl.load(logits_ptr + token * stride_lt + cols, mask=valid, other=float("-inf")).to(tl.float32)
    if TOPK_SOFTMAX:
        scores = logits
    else:
        exp = tl.where(valid, tl.exp(logits - tl.max(logits, 0)), 0.0)
        scores = exp / tl.sum(exp, 0)
    choice = tl.where(valid, scores, float("-inf"))
    slots = tl.arange(0, TOP_K)
    chosen_ids = tl.zeros((TOP_K,), dtype=tl.int32)
    chosen = tl.zeros((TOP_K,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = tl.max(choice, 0)
        # The lowest expert id among those at the best score.
        expert = tl.min(tl.where(choice == best, cols, E_PAD), 0)
        chosen_ids = tl.where(slots == j, expert, chosen_ids)
        chosen = tl.where(slots == j, best, chosen)
        choice = tl.where(cols == expert, float("-inf"), choice)
    if TOPK_SOFTMAX:
        exp = tl.exp(chosen - tl.max(chosen, 0))
        chosen = exp / tl.sum(exp, 0)
    elif RENORMALIZE:
        chosen = chosen / tl.sum(chosen, 0)
    tl.store(weights_ptr + token * TOP_K + slots, chosen)
    tl.store(ids_ptr + token * TOP_K + slots, chosen_ids)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32), as
    `pagellm.ops.moe.select_experts` for `scoring` softmax or topk_softmax. top_k must be a power
    of two (the kernel's tile; the families' 1, 2, 4 and 8)."""
    tokens, experts = router_logits.shape
    if not supports(top_k, experts, scoring, None, None):
        raise ValueError(f"this kernel routes {', '.join(SCORINGS)} scorings with a power-of-two top_k of at most "
                         f"{MAX_EXPERTS} experts, not {scoring!r} top-{top_k} of {experts}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=logits.device)
    if tokens:
        _route_kernel[(tokens,)](logits, weights, ids, experts, logits.stride(0), TOP_K=top_k,
                                 E_PAD=max(16, triton.next_power_of_2(experts)),
                                 TOPK_SOFTMAX=scoring == "topk_softmax", RENORMALIZE=renormalize, num_warps=1)
    return weights, ids


def supports(top_k: int, experts: int, scoring: str, correction_bias: torch.Tensor | None,
             num_groups: int | None) -> bool:
    """Whether `select_experts` here computes this routing (else the torch path does)."""
    return (scoring in SCORINGS and correction_bias is None and num_groups is None
            and 0 < top_k <= experts <= MAX_EXPERTS and not top_k & (top_k - 1))
