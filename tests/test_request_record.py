"""One declaration of a request (`EngineCoreRequest`): it crosses the process boundaries unchanged
(msgspec over ZMQ to the engine core, pickle to worker processes), and what the scheduler, the
workers and the output processor keep of a request is derived from it, not copied field by field."""
from __future__ import annotations

import json
import pickle

import msgspec
import pytest
from engine_utils import TINY_LLAMA

from pagellm.core.outputs import NewRequestData, SchedulerOutput
from pagellm.core.request import EngineCoreRequest, Request
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.output_processor import _RequestState
from pagellm.engine.parallel_sampling import ParentRequest
from pagellm.engine.wire import encoder, input_decoder
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams
from pagellm.worker.batch import CachedRequestState


def make_record(**fields) -> EngineCoreRequest:
    """A record with every field set to something other than its default."""
    params = SamplingParams(temperature=0.5, seed=3, max_tokens=40, stop_token_ids=[11], bad_words=["x"],
                            _bad_words_token_ids=[[3, 4]], logprobs=1, prompt_logprobs=2,
                            structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    return EngineCoreRequest(**{"request_id": "r", "prompt_token_ids": [5, 6, 7, 8, 9], "sampling_params": params,
                                "eos_token_ids": frozenset({2, 3}), "max_tokens": 7, "arrival_time": 123.5,
                                "cache_salt": "tenant-a", **fields})


def test_the_record_crosses_the_wire_and_pickle_unchanged():
    for record in (make_record(), make_record(pooling_params=PoolingParams(normalize=True, dimensions=8),
                                              max_tokens=0)):
        received = input_decoder.decode(encoder.encode(record))
        assert type(received) is EngineCoreRequest and received == record
        assert received.sampling_params._bad_words_token_ids == [[3, 4]], "the processor's private field is kept"
        assert pickle.loads(pickle.dumps(record)) == record
    # As a worker process receives it (mp and Ray executors pickle scheduler outputs).
    record = make_record()
    so = SchedulerOutput([NewRequestData(record=record, output_token_ids=[20], block_ids=([1, 2],),
                                         num_computed_tokens=0)], [], {"r": 6}, 6, set())
    [new] = pickle.loads(pickle.dumps(so)).scheduled_new_reqs
    assert new.record == record and new.req_id == "r" and new.output_token_ids == [20]


def test_the_record_is_frozen_and_keyword_only():
    record = make_record()
    with pytest.raises(AttributeError):
        record.max_tokens = 3
    with pytest.raises(TypeError):
        EngineCoreRequest("r", [1], SamplingParams(), frozenset(), 1)


def test_states_derived_from_the_record_see_its_fields():
    record = make_record()
    request = Request.from_record(record)
    assert request.record is record
    assert (request.request_id, request.prompt_token_ids, request.sampling_params, request.eos_token_ids,
            request.max_tokens, request.pooling_params) == ("r", [5, 6, 7, 8, 9], record.sampling_params,
                                                            {2, 3}, 7, None)
    assert request.num_prompt_tokens == 5 and request.num_output_tokens == 0
    assert request.extra_keys == ("tenant-a",), "the salt is chained into its blocks' hashes"
    request.all_token_ids.append(20)
    assert record.prompt_token_ids == [5, 6, 7, 8, 9], "the scheduler's tokens are its own list"

    resumed = CachedRequestState.from_new(
        NewRequestData(record=record, output_token_ids=[20, 21], block_ids=([1, 2],), num_computed_tokens=4), row=3)
    assert resumed.record is record
    assert (resumed.request_id, resumed.sampling_params, resumed.eos_token_ids, resumed.pooling_params) == (
        "r", record.sampling_params, {2, 3}, None)
    assert (resumed.token_ids, resumed.num_prompt_tokens, resumed.block_ids, resumed.num_computed_tokens,
            resumed.row) == ([5, 6, 7, 8, 9, 20, 21], 5, [[1, 2]], 4, 3)
    assert resumed.uses_processors, "bad words need the logits processors"
    assert resumed.prompt_logprobs_parts is None, "a resumed request delivered its prompt logprobs already"
    fresh = CachedRequestState.from_new(
        NewRequestData(record=record, output_token_ids=[], block_ids=([4],), num_computed_tokens=0), row=0)
    assert fresh.prompt_logprobs_parts == [] and fresh.token_ids == [5, 6, 7, 8, 9]

    state = _RequestState.from_request(record, prompt="text", tokenizer=None)
    assert state.record is record
    assert (state.request_id, state.prompt, state.prompt_token_ids, state.sampling_params, state.arrival_time) == (
        "r", "text", [5, 6, 7, 8, 9], record.sampling_params, 123.5)
    assert state.detokenizer is None and state.logprobs is not None  # no tokenizer; logprobs asked for


def test_children_are_the_parent_record_with_their_own_id_and_params():
    record = make_record(sampling_params=SamplingParams(n=3, seed=7, max_tokens=40))
    children = ParentRequest(record, "text").make_children()
    assert [c.request_id for c in children] == ["0_r", "1_r", "2_r"]
    for i, child in enumerate(children):
        assert (child.sampling_params.n, child.sampling_params.seed) == (1, 7 + i)
        assert child.cache_salt == "tenant-a"
        # Every other field, whichever the record has, is the parent's.
        assert msgspec.structs.replace(child, request_id="r", sampling_params=record.sampling_params) == record


def test_the_arrival_time_given_to_the_engine_is_the_records(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu",
                                                   dtype="float32", max_model_len=64, kv_cache_memory_bytes=4 << 20))
    engine.add_request("r", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2, n=2), arrival_time=42.0)
    assert {r.record.arrival_time for r in engine.engine_core.scheduler.requests.values()} == {42.0}
    finals = []
    while engine.has_unfinished_requests():
        finals += [out for out in engine.step() if out.finished]
    assert [out.metrics["arrival_time"] for out in finals] == [42.0]
