"""Physical floors: model costs from the architecture, workload floors against a brute-force count."""
from __future__ import annotations

import math

import pytest
import torch

from pagellm.benchmarks.roofline import (Ceilings, ModelCost, decode_floor, measure_ceilings, run_floor, serial_floor,
                                       with_fraction)
from pagellm.loader import resolve_model


def test_llama_3_1_8b_cost():
    cost = ModelCost.from_arch(resolve_model("meta-llama/Llama-3.1-8B-Instruct", "dummy").arch, dtype_bytes=2)
    # 8,030,261,248 published parameters, less the embedding table (128256 x 4096) and the norms' 32 * 2 + 1 vectors.
    assert cost.layer_params + cost.lm_head_params == 8_030_261_248 - 128256 * 4096 - 65 * 4096
    assert cost.lm_head_params == 128256 * 4096
    assert cost.kv_bytes_per_token == 128 * 1024  # 32 layers x (K + V) x 8 heads x 128 x 2 bytes
    assert cost.attention_flops_per_pair == 4 * 32 * 32 * 128


def _brute_force(cost: ModelCost, requests: list[tuple[int, int]], steps: int) -> tuple[int, int]:
    """Bytes and FLOPs counted token by token."""
    num_bytes, flops = steps * cost.step_weight_bytes, 0
    for prompt, output in requests:
        for position in range(prompt + output - 1):  # every token that goes through the layers
            flops += 2 * cost.layer_params + cost.attention_flops_per_pair * (position + 1)
            if position >= prompt:  # a decode step reads its whole context's KV
                num_bytes += (position + 1) * cost.kv_bytes_per_token
        flops += 2 * cost.lm_head_params * output
    return num_bytes, flops


@pytest.mark.parametrize("max_num_seqs, budget, expected_steps", [
    (1, None, 5 + 3 + 9),  # one sequence at a time: every output token is its own step
    (8, None, 9),          # all at once: the longest output
    (8, 3, 13),            # 9 + 8 + 21 tokens through the layers, at most 3 per step
])
def test_run_floor_matches_a_token_by_token_count(max_num_seqs, budget, expected_steps):
    cost = ModelCost(layer_params=1000, lm_head_params=300, step_weight_bytes=2600, kv_bytes_per_token=8,
                     attention_flops_per_pair=16)
    ceilings = Ceilings(copy_bytes_per_s=1e4, matmul_flops_per_s=1e5)
    requests = [(5, 5), (6, 3), (13, 9)]
    floor = run_floor(cost, ceilings, requests, max_num_seqs, budget)
    assert floor["min_steps"] == expected_steps
    num_bytes, flops = _brute_force(cost, requests, expected_steps)
    assert (floor["bytes"], floor["flops"]) == (num_bytes, flops)
    assert floor["floor_s"] == max(num_bytes / 1e4, flops / 1e5)
    assert with_fraction(floor, 4 * floor["floor_s"])["fraction_of_floor"] == pytest.approx(0.25)


def test_decode_floor_is_a_one_token_run():
    cost = ModelCost.from_arch(resolve_model("qwen3-8b", "dummy").arch, dtype_bytes=2)
    ceilings = Ceilings(copy_bytes_per_s=4e12, matmul_flops_per_s=7e14)
    one = decode_floor(cost, ceilings, context_len=101)
    # A request whose second output token is its only decode step, at context 101.
    two_tokens = run_floor(cost, ceilings, [(100, 2)], max_num_seqs=1)
    assert one["bytes"] == two_tokens["bytes"] - cost.step_weight_bytes  # the run also has its prefill step
    assert one["memory_s"] > one["compute_s"]  # batch-1 decode is bound by memory


def test_measure_ceilings_on_the_cpu():
    ceilings, record = measure_ceilings(torch.device("cpu"), copy_bytes=1 << 20, matmul_size=64,
                                        dtype=torch.float32, iters=3)
    assert math.isfinite(ceilings.copy_bytes_per_s) and ceilings.copy_bytes_per_s > 0
    assert ceilings.matmul_flops_per_s == pytest.approx(2 * 64 ** 3 / record["matmul_best_s"])
    assert ceilings.copy_bytes_per_s == pytest.approx(2 * (1 << 20) / record["copy_best_s"])


def test_serial_floor_steps_follow_the_schedule_and_never_beat_the_run_floor():
    cost = ModelCost(layer_params=1000, lm_head_params=300, step_weight_bytes=2600, kv_bytes_per_token=8,
                     attention_flops_per_pair=16)
    ceilings = Ceilings(copy_bytes_per_s=1e4, matmul_flops_per_s=1e5)
    requests = [(5, 5), (6, 3), (13, 9)]
    # Budget 8: step 1 prefills 5 + 3 of the second prompt; step 2 decodes one, finishes the
    # second prompt (3) and starts the third (4); steps 3 and 4 decode two and take the third's
    # next 6 and last 3 tokens; its 8 decodes end at step 12.
    serial = serial_floor(cost, ceilings, requests, max_num_seqs=8, max_num_batched_tokens=8)
    assert serial["steps"] == 12
    assert serial["serial_s"] == pytest.approx(serial["matmul_s"] + serial["attention_s"])
    for max_num_seqs, budget in [(1, 100), (8, 100), (8, 3), (2, 7)]:
        serial = serial_floor(cost, ceilings, requests, max_num_seqs, budget)
        floor = run_floor(cost, ceilings, requests, max_num_seqs, budget)
        assert serial["steps"] >= floor["min_steps"]
        assert serial["serial_s"] >= floor["floor_s"]


def test_serial_floor_charges_a_decode_step_its_weights_and_its_kv_reads():
    cost = ModelCost(layer_params=1000, lm_head_params=300, step_weight_bytes=2600, kv_bytes_per_token=8,
                     attention_flops_per_pair=16)
    ceilings = Ceilings(copy_bytes_per_s=1e4, matmul_flops_per_s=1e5)
    serial = serial_floor(cost, ceilings, [(4, 3)], max_num_seqs=1, max_num_batched_tokens=16)
    # Prefill (4 tokens, 10 pairs, 1 sampled), then two decodes at contexts 5 and 6: weight-bound steps.
    prefill = max(2600 / 1e4, (2 * 1000 * 4 + 2 * 300) / 1e5) + 16 * 10 / 1e5
    decodes = sum(2600 / 1e4 + max(8 * c / 1e4, 16 * c / 1e5) for c in (5, 6))
    assert serial["steps"] == 3
    assert serial["serial_s"] == pytest.approx(prefill + decodes)


def test_mixture_of_experts_cost_counts_the_experts_one_token_reads():
    """Qwen3-30B-A3B: a token goes through its router and 8 of 128 experts a layer (3.3B of 30.5B
    parameters with the embedding); Qwen1.5-MoE-A2.7B adds a gated shared expert."""
    cost = ModelCost.from_arch(resolve_model("Qwen/Qwen3-30B-A3B", "dummy").arch, dtype_bytes=2)
    attention = 2048 * 4096 * 2 + 2 * 2048 * 512
    assert cost.layer_params == 48 * (attention + 128 * 2048 + 8 * 3 * 2048 * 768)
    assert cost.step_weight_bytes == 2 * (cost.layer_params + 151936 * 2048)
    qwen15 = ModelCost.from_arch(resolve_model("Qwen/Qwen1.5-MoE-A2.7B", "dummy").arch, dtype_bytes=2)
    expected = 24 * (4 * 2048 * 2048 + 60 * 2048 + 4 * 3 * 2048 * 1408 + 3 * 2048 * 5632 + 2048)
    assert qwen15.layer_params == expected
