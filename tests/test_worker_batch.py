"""The worker's persistent batch: rows reused and grown as requests come and go, each step's inputs
the same as laid out from the requests' own token and block lists."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagellm.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from pagellm.core.request import EngineCoreRequest
from pagellm.sampling_params import SamplingParams
from pagellm.worker.batch import RequestStates, upload

BLOCK = 4


def reference_inputs(states: RequestStates, so: SchedulerOutput) -> tuple[list[int], list[int], list[list[int]]]:
    """input ids (known tokens, 0 for a placeholder), positions and each KV cache group's slots,
    from the lists."""
    ids, positions, slots = [], [], [[] for _ in states.block_tables]
    for req_id, n in so.num_scheduled_tokens.items():
        s = states.states[req_id]
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
            ids.append(s.token_ids[pos] if pos < len(s.token_ids) else 0)
            positions.append(pos)
            for group, blocks in zip(slots, s.block_ids):
                group.append(blocks[pos // BLOCK] * BLOCK + pos % BLOCK)
    return ids, positions, slots


@pytest.mark.parametrize("num_kv_groups", [1, 3])
def test_steps_match_a_layout_from_the_lists_as_requests_come_and_go(num_kv_groups):
    rng = random.Random(0)
    states = RequestStates(BLOCK, torch.device("cpu"), num_kv_groups=num_kv_groups)
    groups = range(num_kv_groups)
    live: dict[str, dict] = {}  # req_id -> {"tokens", "computed", "blocks"}, the scheduler's view
    next_block, next_id, rows_seen = 1, 0, set()
    params = SamplingParams(temperature=0.0)
    for step in range(60):
        freed = set(rng.sample(sorted(live), k=min(len(live), rng.randrange(3)))) if step % 3 == 0 else set()
        for req_id in freed:
            del live[req_id]
        new, cached, scheduled = [], [], {}
        for _ in range(rng.randrange(4) if len(live) < 12 else 0):
            req_id, next_id = f"r{next_id}", next_id + 1
            tokens = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 11))]
            count = -(-len(tokens) // BLOCK)
            blocks = [list(range(next_block + g * count, next_block + (g + 1) * count)) for g in groups]
            next_block += count * num_kv_groups
            live[req_id] = {"tokens": tokens, "computed": 0, "blocks": blocks}
            record = EngineCoreRequest(request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
                                       eos_token_ids=frozenset({2}), max_tokens=16)
            new.append(NewRequestData(record=record, output_token_ids=[], block_ids=tuple(map(list, blocks)),
                                      num_computed_tokens=0))
            scheduled[req_id] = len(tokens)
        for req_id, r in live.items():
            if req_id in scheduled:
                continue
            n = len(r["tokens"]) - r["computed"]  # a decode step: one token, known (no overlap here)
            end = r["computed"] + n
            count = max(0, -(-end // BLOCK) - len(r["blocks"][0]))
            grown = tuple(list(range(next_block + g * count, next_block + (g + 1) * count)) for g in groups)
            next_block += count * num_kv_groups
            for blocks, more in zip(r["blocks"], grown):
                blocks += more
            if count:  # only a request with new blocks is sent again
                cached.append(CachedRequestData(req_id, grown, r["computed"], []))
            scheduled[req_id] = n
        so = SchedulerOutput(new, cached, scheduled, sum(scheduled.values()), freed)
        states.update(so)
        expected = reference_inputs(states, so)
        batch = states.build(so)
        rows_seen |= {states.states[r].row for r in scheduled}
        assert batch.input_ids.tolist() == expected[0]
        assert batch.positions.tolist() == expected[1]
        for g in groups:
            md = batch.attn_metadata.for_group(g)
            assert md.slot_mapping.tolist() == expected[2][g]
            for i, req_id in enumerate(scheduled):
                blocks = live[req_id]["blocks"][g]
                assert md.block_table[i, :len(blocks)].tolist() == blocks
        assert batch.sampling_req_ids == list(scheduled)  # every request reaches its last token
        sampled = [[rng.randrange(1, 1000)] for _ in batch.sampling_req_ids]
        states.append_sampled(batch.sampling_req_ids, sampled)
        for req_id, token in zip(batch.sampling_req_ids, sampled):
            live[req_id]["computed"] += scheduled[req_id]
            live[req_id]["tokens"] += token
        # The worker advanced each request by its scheduled tokens, as the scheduler did.
        assert {r: s.num_computed_tokens for r, s in states.states.items()} == {
            r: v["computed"] for r, v in live.items()}
    # Rows of freed requests were reused: never more rows than requests alive at once.
    assert max(rows_seen) < 16


def test_upload_packs_by_dtype_and_restores_shapes():
    arrays = [np.arange(6, dtype=np.int32).reshape(2, 3), np.array([7, 8], dtype=np.int64),
              np.zeros(0, dtype=np.int64), np.array([-1], dtype=np.int32)]
    got = upload(arrays, torch.device("cpu"))
    assert [t.dtype for t in got] == [torch.int32, torch.int64, torch.int64, torch.int32]
    assert all(t.tolist() == a.tolist() for t, a in zip(got, arrays))
    with pytest.raises(TypeError, match="int32 or int64"):
        upload([np.zeros(2, dtype=np.float32)], torch.device("cpu"))


def test_upload_starts_every_array_16_bytes_aligned():
    arrays = [np.arange(n, dtype=dtype) for n, dtype in ((3, np.int32), (5, np.int32), (1, np.int64), (3, np.int64))]
    got = upload(arrays, torch.device("cpu"))
    assert all(t.data_ptr() % 16 == 0 for t in got)
    assert all(t.tolist() == a.tolist() for t, a in zip(got, arrays))
