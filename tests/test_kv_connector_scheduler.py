"""The KV connector's scheduler side without a model: a worker that tracks which token each KV slot
holds (device blocks and host slots, copied as the connector's metadata says) checks, at every step,
that the KV a request's computation reads is its own tokens', under preemption (recompute and
swap), host-tier hits, and blocks evicted and loaded in one step."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from pagellm.config.kv_transfer import KVOffloadConfig, KVTransferConfig
from pagellm.core.kv_offload import OffloadingScheduler
from pagellm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagellm.core.request import EngineCoreRequest
from pagellm.core.scheduler import Scheduler, SchedulerLimits
from pagellm.sampling_params import SamplingParams

BLOCK = 4


def next_token(history: list[int]) -> int:
    return 10 + sum(t * (i + 1) for i, t in enumerate(history)) % 97


@dataclass
class KVOracle:
    """Device blocks and host slots as {offset in block: token id whose KV is there}."""

    device: dict[int, dict[int, int]] = field(default_factory=dict)
    host: dict[int, dict[int, int]] = field(default_factory=dict)
    reqs: dict[str, tuple[list[int], list[int], list[int]]] = field(default_factory=dict)
    """Request -> (tokens, [num computed], block ids)."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.freed_req_ids:
            del self.reqs[rid]
        meta = out.kv_connector_metadata
        if meta is not None:  # saves read before loads write (the worker's order)
            saved = [dict(self.device.get(b, {})) for b in meta.save_device]
            for slot, block in zip(meta.load_host, meta.load_device):
                self.device[block] = dict(self.host[slot])
            for slot, content in zip(meta.save_host, saved):
                self.host[slot] = content
        for new in out.scheduled_new_reqs:
            tokens = [*new.record.prompt_token_ids, *new.output_token_ids]
            self.reqs[new.req_id] = (tokens, [new.num_computed_tokens], list(new.block_ids[0]))
        for cached in out.scheduled_cached_reqs:
            self.reqs[cached.req_id][2].extend(cached.new_block_ids[0])
        req_ids, sampled = [], []
        for rid, n in out.num_scheduled_tokens.items():
            tokens, computed, blocks = self.reqs[rid]
            start = computed[0]
            for p in range(start):  # what attention reads
                assert self.device.get(blocks[p // BLOCK], {}).get(p % BLOCK) == tokens[p], (rid, p)
            for p in range(start, start + n):
                self.device.setdefault(blocks[p // BLOCK], {})[p % BLOCK] = tokens[p]
            computed[0] = start + n
            if computed[0] == len(tokens):
                tokens.append(next_token(tokens))
                req_ids.append(rid)
                sampled.append([tokens[-1]])
        return ModelRunnerOutput(req_ids, sampled)


def run(mode: str | None, prompts: list[list[int]], max_tokens: list[int], priorities: list[int] | None = None,
        num_blocks: int = 18):
    limits = SchedulerLimits(max_num_batched_tokens=32, max_num_seqs=6, max_model_len=64, block_size=BLOCK,
                             num_blocks=num_blocks, enable_prefix_caching=True)
    connector = None
    if mode is not None:
        config = KVOffloadConfig(KVTransferConfig("OffloadingConnector"), 1, mode)
        connector = OffloadingScheduler(config, BLOCK, num_host_blocks=40)
    sched = Scheduler(limits, connector=connector, swap_preemption=mode == "swap",
                      policy="fcfs" if priorities is None else "priority")
    oracle = KVOracle()
    outputs: dict[str, list[int]] = {}
    pending = list(enumerate(zip(prompts, max_tokens, priorities or [0] * len(prompts))))
    steps = 0
    while pending or sched.has_unfinished_requests():
        if pending and steps % 3 == 0:  # requests keep arriving
            i, (prompt, n, priority) = pending.pop(0)
            sched.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=prompt,
                                                sampling_params=SamplingParams(max_tokens=n, ignore_eos=True),
                                                eos_token_ids=frozenset({2}), max_tokens=n, priority=priority))
        for result in sched.update_from_output(oracle.execute(sched.schedule())):
            outputs.setdefault(result.req_id, []).extend(result.new_token_ids)
        steps += 1
        assert steps < 5000
    assert sched.kv.pool.num_free_blocks == num_blocks
    return outputs, sched.make_stats()


@pytest.mark.parametrize("seed", range(6))
def test_every_step_reads_its_own_kv_with_host_tier_and_swap(seed):
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 60) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    prompts = [rng.choice(shared) + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 14))] for _ in range(24)]
    max_tokens = [rng.randrange(1, 20) for _ in prompts]
    expected, off = run(None, prompts, max_tokens)
    assert off.num_preemptions > 0  # the device pool is too small for the running set
    for mode in ("recompute", "swap"):
        got, stats = run(mode, prompts, max_tokens)
        assert got == expected, mode
        assert stats.kv_transfer.host_hit_tokens > 0
        if mode == "swap":
            assert stats.kv_transfer.swaps_out == stats.num_preemptions > 0
            assert stats.kv_transfer.swaps_in > 0


@pytest.mark.parametrize("seed", range(8))
def test_priority_preemption_withdraws_no_kv_into_the_caches(seed):
    """A waiting request of higher priority preempts a running one whose step is withdrawn: the
    blocks it registered for those tokens hold no KV, and neither the prefix cache nor the host tier
    may serve them."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 60) for _ in range(rng.randrange(6, 20))] for _ in range(3)]
    prompts = [rng.choice(shared) + [rng.randrange(3, 60) for _ in range(rng.randrange(1, 14))] for _ in range(24)]
    max_tokens = [rng.randrange(1, 20) for _ in prompts]
    priorities = [rng.randrange(3) for _ in prompts]
    expected, _ = run(None, prompts, max_tokens, priorities)
    for mode in ("recompute", "swap"):
        got, stats = run(mode, prompts, max_tokens, priorities)
        assert got == expected, mode
        assert stats.num_preemptions > 0
