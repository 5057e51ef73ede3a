"""The routed experts of a mixture-of-experts layer: their weights as two 3-D parameters in the
layout of `pagellm.ops.moe` (w13 [experts, 2 x intermediate, hidden], w2 [experts, hidden,
intermediate]), loaded from Hugging Face's per-expert or stacked tensors, and the router's choice
applied to them.

How the experts are split over the tensor-parallel ranks:
- tensor parallel (default): every rank holds every expert's slice of the intermediate size (w13
  column-parallel: the slice's gate rows, then its up rows; w2 row-parallel);
- expert parallel (`--enable-expert-parallel`, `ParallelState.expert_parallel`): rank r holds
  experts [r x E / tp, (r + 1) x E / tp) whole, and a token's experts held by other ranks are -1
  here (those ranks compute them).
Either way a rank's output is a partial sum over ranks: the caller all-reduces it (once, together
with other partial results of the same layer, such as a shared expert's).

Experts may have biases (GPT-OSS's): `w13_bias` [experts, 2 x intermediate] is split as w13's rows
are, and `w2_bias` [experts, hidden] is held whole. Under tensor parallelism only rank 0 adds the
down bias (every rank's partial sum has the gate/up biases of its own slice), so that the all-reduce
sums it in once; under expert parallelism each rank adds its own experts' (a token's pairs of
another rank's experts are -1 here, and add nothing).

Checkpoints stack an expert's gate and up rows concatenated (transformers' `gate_up_proj`: part
"w13") or alternating, gate, up, gate, ... (GPT-OSS's: part "w13_interleaved"; transformers'
GptOssExperts keeps its weights transposed, [experts, hidden, 2 x intermediate], and its down
projection [experts, intermediate, hidden]: a loader passes them transposed back).
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed import parallel_state
from pagellm.layers.linear import copy_weight, divide
from pagellm.ops.moe import Scoring, fused_moe, select_experts
from pagellm.ops.numerics import MoEActivation

EXPERT_PARTS = ("w1", "w3", "w2")
"""One expert's projections as the weight loader names them (Mixtral's names): gate, up, down."""
STACKED = None
"""The expert of a shard id that stands for every expert at once (a 3-D checkpoint tensor)."""
W13_LAYOUTS = ("w13", "w13_interleaved")
"""Parts holding an expert's gate and up rows in one tensor: concatenated, or alternating."""


class FusedMoE(nn.Module):
    """Routes each token to its `top_k` experts by `router_logits` (`select_experts` with the
    family's options) and returns this rank's partial sum of their weighted outputs."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 scoring: Scoring = "softmax", *, activation: MoEActivation = "silu", bias: bool = False) -> None:
        super().__init__()
        state = parallel_state()
        self.num_experts, self.top_k, self.renormalize, self.scoring = num_experts, top_k, renormalize, scoring
        self.activation = activation
        self.adds_down_bias = state.expert_parallel or state.tp_rank == 0
        """Whether this rank adds the down projection's bias (see the module's docstring)."""
        self.full_intermediate_size = intermediate_size
        if state.expert_parallel:
            self.num_local_experts = divide(num_experts, state.tp_size, "num_experts, with expert parallelism,")
            self.first_expert = state.tp_rank * self.num_local_experts
            self.intermediate_size, self.intermediate_offset = intermediate_size, 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.intermediate_size = divide(intermediate_size, state.tp_size, "moe_intermediate_size")
            self.intermediate_offset = state.tp_rank * self.intermediate_size
        # Device and dtype come from the caller's `torch.device(...)` context and default dtype.
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_size, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate_size),
                                      requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_size),
                                     requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(self.num_local_experts, hidden_size),
                                    requires_grad=False) if bias else None
        for param in (self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias):
            if param is not None:
                param.weight_loader = self.weight_loader
        # Global expert id -> its index here, -1 for another rank's (expert parallel only).
        expert_map = None
        if self.num_local_experts < num_experts:
            local = torch.arange(num_experts, dtype=torch.int32) - self.first_expert
            expert_map = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        self.register_buffer("expert_map", expert_map, persistent=False)

    def local_experts(self) -> range:
        """The global ids of the experts this rank holds."""
        return range(self.first_expert, self.first_expert + self.num_local_experts)

    def shards_filled(self, shard_id: tuple[int | None, str]) -> set[tuple[int, str]]:
        """The (global expert, part) pairs held here that a checkpoint tensor loaded as `shard_id` fills."""
        expert, part = shard_id
        parts = ("w1", "w3") if part in W13_LAYOUTS else (part,)
        experts = self.local_experts() if expert is STACKED else [expert] if expert in self.local_experts() else []
        return {(e, p) for e in experts for p in parts}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: tuple[int | None, str] | None = None) -> None:
        """Copy this rank's share of a checkpoint tensor into `param` (a weight or a bias). `shard_id`:
        (global expert, part) for one expert's [out, in] matrix or [out] bias (part w1: gate, w3: up,
        w2: down), another rank's expert being skipped; or (STACKED, part) for every expert's at
        once, stacked [experts, out, in] ([experts, out]), part "w13" or "w13_interleaved" standing
        for gate and up rows in one [experts, 2 x intermediate, hidden] (see the module's docstring)."""
        if not isinstance(shard_id, tuple) or len(shard_id) != 2:
            raise ValueError(f"expert weights load by (expert, part) shard ids, got {shard_id!r}")
        expert, part = shard_id
        bias = param is self.w13_bias or param is self.w2_bias
        if expert is STACKED:
            if loaded_weight.dim() != param.dim() or loaded_weight.shape[0] != self.num_experts:
                raise ValueError(f"stacked expert {'bias' if bias else 'tensor'} of shape "
                                 f"{tuple(loaded_weight.shape)}: expected [{self.num_experts} experts, out"
                                 f"{'' if bias else ', in'}]")
            size = self.full_intermediate_size
            for e in self.local_experts():
                if part == "w13":
                    self._load_one(e, "w1", loaded_weight[e, :size], bias)
                    self._load_one(e, "w3", loaded_weight[e, size:], bias)
                elif part == "w13_interleaved":
                    self._load_one(e, "w1", loaded_weight[e, 0::2], bias)
                    self._load_one(e, "w3", loaded_weight[e, 1::2], bias)
                else:
                    self._load_one(e, part, loaded_weight[e], bias)
            return
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor of expert {expert}: the model has {self.num_experts} experts")
        if expert in self.local_experts():
            self._load_one(expert, part, loaded_weight, bias)

    def _load_one(self, expert: int, part: str, weight: torch.Tensor, bias: bool) -> None:
        """Copy this rank's slice of one expert's full [out, in] `part` matrix (its [out] bias)."""
        if part not in EXPERT_PARTS:
            raise ValueError(f"expert part must be one of {', '.join(EXPERT_PARTS)} (stacked, also "
                             f"{', '.join(W13_LAYOUTS)}), got {part!r}")
        hidden, full = self.w2_weight.shape[1], self.full_intermediate_size
        expected = ((hidden, full) if part == "w2" else (full, hidden))[:1 if bias else 2]
        if tuple(weight.shape) != expected:
            raise ValueError(f"checkpoint tensor of expert {expert}'s {part} {'bias' if bias else 'projection'} has "
                             f"shape {tuple(weight.shape)}, expected {expected}: does config.json describe the same "
                             "model as the weights?")
        local, size, offset = expert - self.first_expert, self.intermediate_size, self.intermediate_offset
        if part == "w2":  # the bias is whole on every rank (see the module's docstring)
            dst = self.w2_bias if bias else self.w2_weight
            copy_weight(dst.data[local], weight if bias else weight.narrow(1, offset, size))
        else:
            dst = self.w13_bias if bias else self.w13_weight
            rows = dst.data[local].narrow(0, 0 if part == "w1" else size, size)
            copy_weight(rows, weight.narrow(0, offset, size))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], router_logits [T, experts] -> this rank's partial output [T, hidden]."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize, self.scoring)
        if self.expert_map is not None:
            topk_ids = self.expert_map[topk_ids.long()]
        # Triton on a GPU (graph-safe: no host sync), the torch oracle elsewhere.
        return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, w13_bias=self.w13_bias,
                         w2_bias=self.w2_bias if self.adds_down_bias else None, activation=self.activation)
