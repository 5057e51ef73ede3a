"""Physical floors: the least time a workload can take on a machine, from bytes moved and FLOPs done.

The machine's ceilings are measured, not taken from a datasheet: device-to-device copy bandwidth
(bytes read plus written per second) and the rate of one large matmul. A workload's floor is
max(bytes / bandwidth, FLOPs / matmul rate), each summed over the whole workload, which no schedule
can beat (each sum alone is a lower bound). Bytes: all weight matrices once per forward step (the
embedding table is only gathered from, so it is left out), plus every decode step's read of the
KV cache of its context. FLOPs: 2 per weight per token through the layers, the LM head only for
tokens that are sampled, and 4 * layers * heads * head_dim per (query, key) pair of attention.
Norms, biases, activations and the KV writes are left out: the floor stays a lower bound. A mixture
of experts counts what one token goes through: its router, its top-k experts and a shared expert; a
step of many tokens reads more experts, which is left out too (all tokens may pick the same ones).
A result's `fraction_of_floor` is floor time / achieved time (1.0 would be the hardware's limit).

`serial_floor` is tighter for engines that run attention after the projections within a step (this
one, vLLM, SGLang): it follows the scheduler's policy step by step and charges each step
max(weights, matmul FLOPs) plus its attention, since a step's two cannot hide each other.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pagellm.config.arch import ModelArchConfig


@dataclass(frozen=True, slots=True)
class Ceilings:
    copy_bytes_per_s: float
    """Device-to-device copy: bytes read + bytes written per second."""
    matmul_flops_per_s: float


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What a model costs per token, from its architecture (weight matrices only)."""

    layer_params: int
    """Weights of the decoder layers' matrices a token multiplies (attention projections and MLP; of a
    mixture of experts, the router, the top-k experts and the shared expert)."""
    lm_head_params: int
    step_weight_bytes: int
    """Bytes of every matrix a forward step of one token reads in full: the layers (of a mixture of
    experts, the experts that token goes to) and the LM head."""
    kv_bytes_per_token: int
    """K and V of one token over all layers."""
    attention_flops_per_pair: int
    """FLOPs of one query token attending to one key token (QK^T and PV) over all layers."""

    @classmethod
    def from_arch(cls, arch: ModelArchConfig, dtype_bytes: int) -> "ModelCost":
        h, d = arch.hidden_size, arch.head_dim
        q, kv = arch.num_attention_heads * d, arch.num_key_value_heads * d
        attention = h * q + 2 * h * kv + q * h
        shared = arch.shared_expert_intermediate_size
        moe_mlp = (h * arch.num_experts + arch.num_experts_per_tok * 3 * h * arch.moe_intermediate_size
                   + (3 * h * shared + h if shared else 0))
        layer_params = sum(attention + (moe_mlp if arch.is_moe_layer(i) else 3 * h * arch.intermediate_size)
                           for i in range(arch.num_hidden_layers))
        lm_head = arch.vocab_size * h
        return cls(
            layer_params=layer_params,
            lm_head_params=lm_head,
            step_weight_bytes=(layer_params + lm_head) * dtype_bytes,
            kv_bytes_per_token=2 * arch.num_hidden_layers * kv * dtype_bytes,
            attention_flops_per_pair=4 * arch.num_hidden_layers * q,
        )


def decode_floor(cost: ModelCost, ceilings: Ceilings, context_len: int, batch_size: int = 1) -> dict[str, float]:
    """Floor of one decode step of `batch_size` sequences that each attend to `context_len` tokens."""
    num_bytes = cost.step_weight_bytes + batch_size * context_len * cost.kv_bytes_per_token
    flops = batch_size * (2 * (cost.layer_params + cost.lm_head_params)
                          + cost.attention_flops_per_pair * context_len)
    return _floor(num_bytes, flops, ceilings)


def run_floor(cost: ModelCost, ceilings: Ceilings, requests: Sequence[tuple[int, int]], max_num_seqs: int,
              max_num_batched_tokens: int | None = None) -> dict[str, float]:
    """Floor of running `(prompt_len, output_len)` requests, at most `max_num_seqs` sequences and
    `max_num_batched_tokens` tokens per forward step.

    The first output token comes from the prefill step, each later one from a decode step that
    processes the previous token at position prompt_len + j - 1 and reads the KV of its context.
    """
    decode_pairs = sum(sum_range(p + 1, p + o - 1) for p, o in requests)  # keys seen by decode tokens
    prefill_pairs = sum(p * (p + 1) // 2 for p, _ in requests)
    tokens = sum(p + o - 1 for p, o in requests)
    outputs = sum(o for _, o in requests)
    min_steps = max(max(o for _, o in requests), math.ceil(outputs / max_num_seqs),
                    math.ceil(tokens / max_num_batched_tokens) if max_num_batched_tokens else 0)
    num_bytes = min_steps * cost.step_weight_bytes + decode_pairs * cost.kv_bytes_per_token
    flops = (2 * cost.layer_params * tokens + 2 * cost.lm_head_params * outputs
             + cost.attention_flops_per_pair * (prefill_pairs + decode_pairs))
    return {**_floor(num_bytes, flops, ceilings), "min_steps": min_steps}


def serial_floor(cost: ModelCost, ceilings: Ceilings, requests: Sequence[tuple[int, int]], max_num_seqs: int,
                 max_num_batched_tokens: int) -> dict[str, float]:
    """Floor of running `(prompt_len, output_len)` requests, all queued at once, under the scheduler's
    policy (decodes first, then prompt chunks first come first served within the token budget, at
    most `max_num_seqs` running; KV capacity and preemption not modelled), when a step's attention
    runs after its matmuls: each step costs max(weight bytes / bandwidth, matmul FLOPs / matmul
    rate) plus its attention (decodes: the larger of KV bytes / bandwidth and FLOPs / matmul rate;
    prompt chunks: FLOPs / matmul rate).

    Returns the floor and its parts: `serial_s`, `steps`, `matmul_s`, `attention_s`.
    """
    pending = list(enumerate(requests))[::-1]  # waiting, first served last in the list
    running: dict[int, list[int]] = {}  # index -> [prompt tokens done, tokens generated]
    steps = 0
    matmul_s = attention_s = 0.0
    while pending or running:
        budget, tokens, sampled, kv_tokens, prompt_pairs = max_num_batched_tokens, 0, 0, 0, 0
        for i, (done, generated) in running.items():
            prompt, _ = requests[i]
            if done == prompt:  # decode: the token at prompt + generated - 1 attends prompt + generated keys
                kv_tokens += prompt + generated
                running[i][1] += 1
                tokens, sampled, budget = tokens + 1, sampled + 1, budget - 1
        for i, state in running.items():
            prompt = requests[i][0]
            if state[0] < prompt and budget > 0:
                chunk = min(prompt - state[0], budget)
                prompt_pairs += sum_range(state[0] + 1, state[0] + chunk)
                state[0] += chunk
                if state[0] == prompt:  # the prompt's last chunk samples the first output token
                    state[1], sampled = 1, sampled + 1
                tokens, budget = tokens + chunk, budget - chunk
        while pending and budget > 0 and len(running) < max_num_seqs:
            i, (prompt, _) = pending.pop()
            chunk = min(prompt, budget)
            prompt_pairs += sum_range(1, chunk)
            running[i] = [chunk, 1 if chunk == prompt else 0]
            sampled += chunk == prompt
            tokens, budget = tokens + chunk, budget - chunk
        step_matmul_s, step_attention_s = serial_step_s(cost, ceilings, tokens, sampled, kv_tokens, prompt_pairs)
        matmul_s += step_matmul_s
        attention_s += step_attention_s
        steps += 1
        running = {i: state for i, state in running.items() if state[1] < requests[i][1]}
    return {"serial_s": matmul_s + attention_s, "steps": steps, "matmul_s": matmul_s, "attention_s": attention_s}


def serial_step_s(cost: ModelCost, ceilings: Ceilings, tokens: int, sampled: int, kv_tokens: int,
                  prompt_pairs: int) -> tuple[float, float]:
    """The least time of one step whose attention runs after its matmuls, as (matmuls, attention):
    `tokens` through the layers, `sampled` of them through the LM head, decodes attending to
    `kv_tokens` cached keys in all, and `prompt_pairs` (query, key) pairs of prompt chunks."""
    bw, rate = ceilings.copy_bytes_per_s, ceilings.matmul_flops_per_s
    flops = 2 * cost.layer_params * tokens + 2 * cost.lm_head_params * sampled
    matmul_s = max(cost.step_weight_bytes / bw, flops / rate)
    attention_s = (max(kv_tokens * cost.kv_bytes_per_token / bw, cost.attention_flops_per_pair * kv_tokens / rate)
                   + cost.attention_flops_per_pair * prompt_pairs / rate)
    return matmul_s, attention_s


def with_fraction(floor: dict[str, float], achieved_s: float) -> dict[str, float]:
    """`floor` plus how close `achieved_s` came to it."""
    return {**floor, "achieved_s": achieved_s, "fraction_of_floor": floor["floor_s"] / achieved_s}


def measure_ceilings(device: torch.device, copy_bytes: int, matmul_size: int, dtype: torch.dtype,
                     iters: int = 10) -> tuple[Ceilings, dict[str, Any]]:
    """Measured copy bandwidth and matmul rate on `device` (best of `iters` after a warm-up), and
    the record of how they were measured."""
    copy_s = _copy_seconds(device, copy_bytes, iters)
    matmul_s = _matmul_seconds(device, matmul_size, dtype, iters)
    ceilings = Ceilings(copy_bytes_per_s=2 * copy_bytes / copy_s, matmul_flops_per_s=2 * matmul_size ** 3 / matmul_s)
    record = {**asdict(ceilings), "copy_buffer_bytes": copy_bytes, "copy_best_s": copy_s,
              "matmul_shape": [matmul_size] * 3, "matmul_dtype": str(dtype).removeprefix("torch."),
              "matmul_best_s": matmul_s, "iters": iters, "device": str(device)}
    return ceilings, record


def _floor(num_bytes: float, flops: float, ceilings: Ceilings) -> dict[str, float]:
    memory_s = num_bytes / ceilings.copy_bytes_per_s
    compute_s = flops / ceilings.matmul_flops_per_s
    return {"bytes": num_bytes, "flops": flops, "memory_s": memory_s, "compute_s": compute_s,
            "floor_s": max(memory_s, compute_s)}


def sum_range(first: int, last: int) -> int:
    """first + (first + 1) + ... + last; 0 when last < first."""
    return (first + last) * (last - first + 1) // 2 if last >= first else 0


def _copy_seconds(device: torch.device, num_bytes: int, iters: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return _best_seconds(lambda: dst.copy_(src), device, iters)


def _matmul_seconds(device: torch.device, size: int, dtype: torch.dtype, iters: int) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    return _best_seconds(lambda: torch.matmul(a, b), device, iters)


def _best_seconds(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    fn()  # warm-up: allocator, kernel selection
    best = math.inf
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best
