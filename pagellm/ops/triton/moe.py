"""Mixture-of-Experts on the GPU: every token's experts' MLPs in a few Triton launches, no host sync.

The layout and the torch oracle are `pagellm.ops.moe`'s. A call runs
1. the plan (`align_by_expert`): the (token, k) pairs grouped by expert, each expert's pairs from a
   block boundary, in blocks of BLOCK_M pairs of one expert; pairs of expert -1 (another rank's)
   belong to no block. One planning kernel where the pairs fit one program's one-hot tile (decode),
   else three (count per chunk, scan, scatter);
2. the gate/up product: a program per (block, BLOCK_N columns of the intermediate size) multiplies
   the block's tokens by the expert's gate rows and its up rows together, adds the expert's biases
   where there are, and writes only the activation of the two (silu(gate) * up, or GPT-OSS's
   clamped SwiGLU), in the activations' dtype, at the block's rows of a [blocks x BLOCK_M, I] buffer;
3. the down product: a program per (block, BLOCK_N columns of hidden) multiplies those rows by the
   expert's down projection, adds its bias where there is one, and writes each pair's row of
   [T x k, H] times its routing weight;
4. the sum over k of each token's pairs in float32, in a fixed order (deterministic, no atomics).

A pair of no expert here (-1) is in no block, so neither its expert's weights nor its biases are
read: under expert parallelism another rank adds them. Under tensor parallelism the caller passes
the down bias on one rank only (`pagellm.layers.moe`), so that the all-reduce sums it in once.

Every buffer's size follows from T, k and the number of experts alone, and unused blocks (an expert
without tokens gets none; the plan's spare blocks are marked -1) return at once: a CUDA graph
captured for T tokens replays correctly whatever experts the next step's tokens choose. A block
reads only its own expert's weights, so a decode step reads only the chosen experts' (BLOCK_M = 16,
tl.dot's least, when experts get few tokens each). Products accumulate in float32; float32 inputs
multiply exactly (not TF32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagellm.ops.dispatch import triton_interpreting
from pagellm.ops.numerics import MOE_ACTIVATIONS, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, MoEActivation
from pagellm.ops.triton.utils import dot_f32


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Tiles of the two grouped products: BLOCK_M pairs of one expert by BLOCK_N output columns,
    BLOCK_K inputs a step (powers of two; BLOCK_M at least 16, tl.dot's least)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


_CONFIGS: tuple[tuple[float, MoEConfig], ...] = (
    # (most pairs an expert gets on average, tiles). Decode: a block per chosen expert, narrow
    # column tiles so that the few blocks still make enough programs to stream the weights.
    (16, MoEConfig(16, 32, 128, 4, 4)),
    (64, MoEConfig(32, 64, 64, 4, 4)),
    (256, MoEConfig(64, 64, 64, 4, 3)),
    (math.inf, MoEConfig(64, 128, 64, 8, 3)),
)
_FLOAT32_BLOCK_K = 32
"""float32 tiles take twice the shared memory a pipeline stage."""
_ONEHOT_ELEMENTS = 8192
"""Elements of a planning program's [pairs, experts] one-hot tile (registers: 32 a thread)."""
_PLAN_WARPS = 8
_MIN_BLOCK = 16  # tl.dot's least dimension; also the least tile of the plan's kernels
_SUM_BLOCK_H = 1024
MAX_EXPERTS = _ONEHOT_ELEMENTS // _MIN_BLOCK
"""The most experts the plan handles (a rank's, under expert parallelism)."""


def choose_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoEConfig:
    """The tiles for `num_pairs` (token, k) pairs over `num_experts` experts: bigger blocks as
    experts get more pairs each."""
    per_expert = num_pairs / max(num_experts, 1)
    config = next(c for limit, c in _CONFIGS if per_expert <= limit)
    if dtype == torch.float32:
        config = replace(config, block_k=min(config.block_k, _FLOAT32_BLOCK_K))
    return config


@dataclass(frozen=True, slots=True)
class ExpertBlocks:
    """The (token, k) pairs in blocks of one expert each (int32 tensors on the pairs' device).

    Pair p is token p // k's k-th choice (`topk_ids.view(-1)[p]`). Block b holds the pairs
    `sorted_pairs[b * block_m : b * block_m + block_rows[b]]`, all of expert `block_expert[b]`, in
    increasing order; the rest of its slice is never written (nor read). An expert's blocks are
    consecutive, its pairs in order across them, every block full but its last."""

    sorted_pairs: torch.Tensor
    """[num_blocks x block_m]"""
    block_expert: torch.Tensor
    """[num_blocks]: each block's expert; -1: a spare block (the fixed size exceeds what the pairs need)."""
    block_rows: torch.Tensor
    """[num_blocks]: the pairs each block holds, 1 to block_m (0 for a spare block)."""
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks `num_pairs` pairs over `num_experts` experts need: a full block per block_m
    pairs, and one partial block at most per expert that has pairs."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


@triton.jit
def _onehot(ids_ptr, start, N, E, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Pairs start .. start + CHUNK: their indices, and the one-hot [CHUNK, E_PAD] int32 of their
    experts (a row of zeros for a pair past N or of an expert outside 0 .. E - 1)."""
    idx = start + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + idx, mask=idx < N, other=-1).to(tl.int32)
    cols = tl.arange(0, E_PAD)
    hot = (ids[:, None] == cols[None, :]) & (cols[None, :] < E)
    return idx, hot.to(tl.int32)


@triton.jit
def _expert_blocks(totals, BLOCK_M: tl.constexpr):
    """Each expert's number of blocks and its first block, from its pairs (all [E_PAD])."""
    blocks = (totals + BLOCK_M - 1) // BLOCK_M
    return blocks, tl.cumsum(blocks, 0) - blocks


@triton.jit
def _write_blocks(block_expert_ptr, block_rows_ptr, totals, blocks, first, num_blocks,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, B_TILE: tl.constexpr):
    """Every block's expert (-1: spare) and number of pairs."""
    cols = tl.arange(0, E_PAD)
    for b0 in range(0, num_blocks, B_TILE):
        b = b0 + tl.arange(0, B_TILE)
        offset = b[:, None] - first[None, :]  # the block's index among each expert's
        inside = (offset >= 0) & (offset < blocks[None, :])
        expert = tl.sum(tl.where(inside, cols[None, :], 0), 1)
        rows = tl.sum(tl.where(inside, tl.minimum(totals[None, :] - offset * BLOCK_M, BLOCK_M), 0), 1)
        used = tl.sum(inside.to(tl.int32), 1) > 0
        tl.store(block_expert_ptr + b, tl.where(used, expert, -1), mask=b < num_blocks)
        tl.store(block_rows_ptr + b, rows, mask=b < num_blocks)


@triton.jit
def _scatter(sorted_ptr, idx, hot, base):
    """Each pair of the chunk to `base[e]` (where the chunk's first pair of expert e goes) plus the
    number of the chunk's earlier pairs of e: the pairs of an expert keep their order."""
    earlier = tl.cumsum(hot, 0) - hot
    dest = tl.sum(hot * (earlier + base[None, :]), 1)
    tl.store(sorted_ptr + dest, idx, mask=tl.sum(hot, 1) > 0)


@triton.jit
def _plan_one_kernel(ids_ptr, sorted_ptr, block_expert_ptr, block_rows_ptr, N, E, num_blocks,
                     BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr, B_TILE: tl.constexpr):
    """The whole plan in one program, for N <= CHUNK pairs."""
    idx, hot = _onehot(ids_ptr, 0, N, E, CHUNK, E_PAD)
    totals = tl.sum(hot, 0)
    blocks, first = _expert_blocks(totals, BLOCK_M)
    _write_blocks(block_expert_ptr, block_rows_ptr, totals, blocks, first, num_blocks, BLOCK_M, E_PAD, B_TILE)
    _scatter(sorted_ptr, idx, hot, first * BLOCK_M)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, N, E, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """counts[c, e]: the pairs of expert e in chunk c (a program per chunk)."""
    chunk = tl.program_id(0)
    _, hot = _onehot(ids_ptr, chunk * CHUNK, N, E, CHUNK, E_PAD)
    tl.store(counts_ptr + chunk * E_PAD + tl.arange(0, E_PAD), tl.sum(hot, 0))


@triton.jit
def _scan_kernel(counts_ptr, block_expert_ptr, block_rows_ptr, num_chunks, E, num_blocks,
                 BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, C_TILE: tl.constexpr, B_TILE: tl.constexpr):
    """One program: the blocks from the experts' totals, and counts[c, e] replaced by where chunk
    c's first pair of expert e goes (the expert's first row plus its pairs in earlier chunks)."""
    cols = tl.arange(0, E_PAD)
    totals = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, C_TILE):
        c = c0 + tl.arange(0, C_TILE)
        tile = tl.load(counts_ptr + c[:, None] * E_PAD + cols[None, :], mask=(c < num_chunks)[:, None], other=0)
        totals += tl.sum(tile, 0)
    blocks, first = _expert_blocks(totals, BLOCK_M)
    _write_blocks(block_expert_ptr, block_rows_ptr, totals, blocks, first, num_blocks, BLOCK_M, E_PAD, B_TILE)
    running = first * BLOCK_M
    for c0 in range(0, num_chunks, C_TILE):
        c = c0 + tl.arange(0, C_TILE)
        ptrs = counts_ptr + c[:, None] * E_PAD + cols[None, :]
        c_ok = (c < num_chunks)[:, None]
        tile = tl.load(ptrs, mask=c_ok, other=0)
        tl.store(ptrs, tl.cumsum(tile, 0) - tile + running[None, :], mask=c_ok)
        running += tl.sum(tile, 0)


@triton.jit
def _scatter_kernel(ids_ptr, bases_ptr, sorted_ptr, N, E, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    """Each chunk's pairs to their places (a program per chunk; `bases` from `_scan_kernel`)."""
    chunk = tl.program_id(0)
    idx, hot = _onehot(ids_ptr, chunk * CHUNK, N, E, CHUNK, E_PAD)
    _scatter(sorted_ptr, idx, hot, tl.load(bases_ptr + chunk * E_PAD + tl.arange(0, E_PAD)))


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    chunk: int | None = None) -> ExpertBlocks:
    """The pairs of `topk_ids` [T, k] in blocks of `block_m` (see `ExpertBlocks`), `max_blocks` of
    them, on the device without a host sync. An id outside 0 .. num_experts - 1 (-1: another
    rank's expert) is in no block. `chunk`: pairs a planning program takes (a power of two; default
    as many as its one-hot tile holds)."""
    if not 0 < num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts must be 1 to {MAX_EXPERTS}, not {num_experts}")
    if block_m < _MIN_BLOCK or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {_MIN_BLOCK}, not {block_m}")
    ids = topk_ids.contiguous().view(-1)
    n = ids.numel()
    e_pad = max(_MIN_BLOCK, triton.next_power_of_2(num_experts))
    tile = _ONEHOT_ELEMENTS // e_pad  # rows of a [rows, E_PAD] tile
    chunk = chunk or tile
    if chunk < _MIN_BLOCK or chunk & (chunk - 1):
        raise ValueError(f"chunk must be a power of two >= {_MIN_BLOCK}, not {chunk}")
    blocks = max_blocks(n, num_experts, block_m)
    device = ids.device
    plan = ExpertBlocks(torch.empty(blocks * block_m, dtype=torch.int32, device=device),
                        torch.empty(blocks, dtype=torch.int32, device=device),
                        torch.empty(blocks, dtype=torch.int32, device=device), block_m)
    if blocks == 0:
        return plan
    if n <= chunk:
        _plan_one_kernel[(1,)](ids, plan.sorted_pairs, plan.block_expert, plan.block_rows, n, num_experts, blocks,
                               BLOCK_M=block_m, CHUNK=max(_MIN_BLOCK, triton.next_power_of_2(n)), E_PAD=e_pad,
                               B_TILE=tile, num_warps=_PLAN_WARPS)
        return plan
    num_chunks = triton.cdiv(n, chunk)
    bases = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=device)
    _count_kernel[(num_chunks,)](ids, bases, n, num_experts, CHUNK=chunk, E_PAD=e_pad, num_warps=_PLAN_WARPS)
    _scan_kernel[(1,)](bases, plan.block_expert, plan.block_rows, num_chunks, num_experts, blocks,
                       BLOCK_M=block_m, E_PAD=e_pad, C_TILE=tile, B_TILE=tile, num_warps=_PLAN_WARPS)
    _scatter_kernel[(num_chunks,)](ids, bases, plan.sorted_pairs, n, num_experts, CHUNK=chunk, E_PAD=e_pad,
                                   num_warps=_PLAN_WARPS)
    return plan


@triton.jit
def _block_pairs(sorted_ptr, block_expert_ptr, block_rows_ptr, BLOCK_M: tl.constexpr):
    """This program's block: its expert (-1: spare), its rows of the sorted layout (int64), which
    of them hold a pair, and those pairs (0 where none)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    r = tl.arange(0, BLOCK_M)
    m_ok = r < tl.load(block_rows_ptr + block)
    slots = block.to(tl.int64) * BLOCK_M + r
    pairs = tl.load(sorted_ptr + slots, mask=m_ok, other=0)
    return expert, slots, m_ok, pairs


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, h_ptr,  # x [T, H], w13 [E, 2 INTER, H], h [blocks x BLOCK_M, INTER]; last dims contiguous
    b13_ptr,  # w13's bias [E, 2 INTER] (read only if HAS_BIAS)
    sorted_ptr, block_expert_ptr, block_rows_ptr,  # the plan
    H, INTER,
    stride_xt, stride_we, stride_wn, stride_hm, stride_be,
    alpha, limit,  # the clamped SwiGLU's
    TOP_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,  # see `dot_f32`
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,  # an index of MOE_ACTIVATIONS: 0 silu, 1 swigluoai
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, slots, m_ok, pairs = _block_pairs(sorted_ptr, block_expert_ptr, block_rows_ptr, BLOCK_M)
    if expert < 0:
        return
    tokens = (pairs // TOP_K).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < INTER
    w_expert = w13_ptr + expert.to(tl.int64) * stride_we
    gate_rows = w_expert + rn[:, None].to(tl.int64) * stride_wn
    up_rows = w_expert + (rn + INTER)[:, None].to(tl.int64) * stride_wn
    x_rows = x_ptr + tokens[:, None] * stride_xt
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        gate += dot_f32(x, tl.trans(tl.load(gate_rows + rk[None, :], mask=w_mask, other=0.0)), IEEE, INTERPRET)
        up += dot_f32(x, tl.trans(tl.load(up_rows + rk[None, :], mask=w_mask, other=0.0)), IEEE, INTERPRET)
    if HAS_BIAS:
        b_expert = b13_ptr + expert.to(tl.int64) * stride_be
        gate += tl.load(b_expert + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_expert + INTER + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == 0:
        h = gate / (1.0 + tl.exp(-gate)) * up
    else:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    tl.store(h_ptr + slots[:, None] * stride_hm + rn[None, :], h.to(h_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, weights_ptr, out_ptr,  # h [blocks x BLOCK_M, INTER], w2 [E, H, INTER], weights [T k], out [T k, H]
    b2_ptr,  # w2's bias [E, H] (read only if HAS_BIAS)
    sorted_ptr, block_expert_ptr, block_rows_ptr,  # the plan
    H, INTER,
    stride_hm, stride_we, stride_wn, stride_om, stride_be,
    IEEE: tl.constexpr, INTERPRET: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    expert, slots, m_ok, pairs = _block_pairs(sorted_ptr, block_expert_ptr, block_rows_ptr, BLOCK_M)
    if expert < 0:
        return
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    w_rows = w2_ptr + expert.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn
    h_rows = h_ptr + slots[:, None] * stride_hm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < INTER
        h = tl.load(h_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += dot_f32(h, tl.trans(w), IEEE, INTERPRET)
    if HAS_BIAS:  # before the routing weight, which scales the expert's whole output
        acc += tl.load(b2_ptr + expert.to(tl.int64) * stride_be + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pairs, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_k_kernel(pair_out_ptr, ids_ptr, out_ptr, H, E, stride_pm, stride_om,
                  TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = the sum of token t's pairs' rows in float32, k in order; a pair of no expert here
    (never written) adds nothing."""
    token = tl.program_id(0).to(tl.int64)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = rh < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        # The id as a vector: Triton's interpreter refuses a mask that combines a scalar with a vector.
        expert = tl.load(ids_ptr + pair) + tl.zeros((BLOCK_H,), dtype=tl.int32)
        row = tl.load(pair_out_ptr + pair * stride_pm + rh, mask=h_ok & (expert >= 0) & (expert < E), other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + token * stride_om + rh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, config: MoEConfig | None = None, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, activation: MoEActivation = "silu") -> torch.Tensor:
    """x [T, H] through the experts of `topk_ids` [T, k] (`pagellm.ops.moe`'s layout, biases and
    activations; shapes checked there), weighted by `topk_weights` [T, k] and summed over k: [T, H]
    in x's dtype. An id outside 0 .. E - 1 (-1: an expert of another rank) adds nothing.
    `config`: the tiles (default: `choose_config`'s)."""
    if any(t.stride(-1) != 1 for t in (w13, w2, *(b for b in (w13_bias, w2_bias) if b is not None))):
        raise ValueError("w13, w2 and their biases need a contiguous last dimension")
    x = x if x.stride(-1) == 1 else x.contiguous()
    tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0 or top_k == 0:
        return out.zero_()
    config = config or choose_config(tokens * top_k, num_experts, x.dtype)
    ids = topk_ids.contiguous()
    plan = align_by_expert(ids, num_experts, config.block_m)
    interpret, ieee = triton_interpreting(), x.dtype == torch.float32
    h = torch.empty(plan.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    # Without a bias the kernels never read their bias pointer: the weights stand in for it.
    b13, b2 = (w if b is None else b for w, b in ((w13, w13_bias), (w2, w2_bias)))
    _gate_up_kernel[(plan.num_blocks, triton.cdiv(inter, config.block_n))](
        x, w13, h, b13, plan.sorted_pairs, plan.block_expert, plan.block_rows, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), b13.stride(0), SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT,
        TOP_K=top_k, IEEE=ieee, INTERPRET=interpret, HAS_BIAS=w13_bias is not None,
        ACTIVATION=MOE_ACTIVATIONS.index(activation),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    pair_out = torch.empty(tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(plan.num_blocks, triton.cdiv(hidden, config.block_n))](
        h, w2, topk_weights.contiguous(), pair_out, b2, plan.sorted_pairs, plan.block_expert, plan.block_rows,
        hidden, inter, h.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), b2.stride(0),
        IEEE=ieee, INTERPRET=interpret, HAS_BIAS=w2_bias is not None,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    block_h = min(_SUM_BLOCK_H, triton.next_power_of_2(hidden))
    _sum_k_kernel[(tokens, triton.cdiv(hidden, block_h))](
        pair_out, ids, out, hidden, num_experts, pair_out.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block_h,
        num_warps=4,
    )
    return out
