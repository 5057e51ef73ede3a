"""Output processing: incremental detokenization, stop strings and RequestOutput assembly, per request."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from pagellm.core.outputs import EngineCoreOutput
from pagellm.core.request import EngineCoreRequest, RecordFields
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.logprobs import LogprobsState
from pagellm.engine.parallel_sampling import ParentRequest, needs_fan_out
from pagellm.metrics.stats import FinishedRequestStats, IterationStats
from pagellm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagellm.sampling_params import RequestOutputKind
from pagellm.tokenizer import Tokenizer


@dataclass(slots=True, kw_only=True)
class _RequestState(RecordFields):
    """One sequence the engine core runs: a plain request or one child of a ParentRequest, as its
    record says, and what has come back of it so far."""

    record: EngineCoreRequest
    prompt: str | None
    detokenizer: IncrementalDetokenizer | None
    """None with detokenize=False or without a tokenizer: token ids only, text ''."""
    parent: ParentRequest | None = None
    index: int = 0
    """Position in the parent's outputs."""
    token_ids: list[int] = field(default_factory=list)
    num_sent_tokens: int = 0
    """Token ids already reported (DELTA outputs carry only the ones after these)."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    logprobs: LogprobsState | None = None
    """None unless the request asked for logprobs or prompt_logprobs."""

    @classmethod
    def from_request(cls, record: EngineCoreRequest, *, prompt: str | None, tokenizer: Tokenizer | None,
                     parent: ParentRequest | None = None, index: int = 0) -> _RequestState:
        """The state of a request just sent to the engine core (`prompt`: its text, if any)."""
        params = record.sampling_params
        return cls(record=record, prompt=prompt,
                   detokenizer=IncrementalDetokenizer(tokenizer, params) if tokenizer and params.detokenize else None,
                   parent=parent, index=index,
                   logprobs=LogprobsState(params, tokenizer) if LogprobsState.wanted(params) else None)


@dataclass(slots=True)
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]
    """Requests a stop string ended here that the engine core still runs: abort them there."""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, pooling: bool = False) -> None:
        """`pooling`: the engine runs the pooling runner, whose requests end with one vector each."""
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.states: dict[str, _RequestState] = {}
        self.parents: dict[str, ParentRequest] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents

    def add_request(self, record: EngineCoreRequest, prompt: str | None) -> list[EngineCoreRequest]:
        """Track a validated request; returns the records the engine core must run: the request's
        own, or its children's when it samples several sequences (n > 1, best_of)."""
        if record.request_id in self:
            raise ValueError(f"request_id {record.request_id!r} is already in use")
        if not needs_fan_out(record.sampling_params):
            self.states[record.request_id] = _RequestState.from_request(record, prompt=prompt, tokenizer=self.tokenizer)
            return [record]
        parent = ParentRequest(record, prompt)
        children = parent.make_children()
        taken = [c.request_id for c in children if c.request_id in self]
        if taken:  # checked first: all children start or none does
            raise ValueError(f"request_id {taken[0]!r} (a child of {record.request_id!r}) is already in use")
        self.parents[parent.request_id] = parent
        for index, child in enumerate(children):
            self.states[child.request_id] = _RequestState.from_request(
                child, prompt=prompt, tokenizer=self.tokenizer, parent=parent, index=index)
        return children

    def core_request_ids(self, request_ids: list[str]) -> list[str]:
        """The ids the engine core knows for these caller ids (a parent's children in its place)."""
        ids = []
        for req_id in request_ids:
            parent = self.parents.get(req_id)
            ids.extend(parent.child_ids if parent is not None else [req_id])
        return ids

    def caller_request_id(self, request_id: str) -> str:
        """The id the caller knows for an engine-core id (a child's parent)."""
        state = self.states.get(request_id)
        return state.parent.request_id if state is not None and state.parent is not None else request_id

    def abort(self, request_ids: list[str], stats: IterationStats | None = None) -> list[RequestOutput]:
        """Forget aborted requests (a parent's id aborts all its children); returns their final
        outputs (finish_reason 'abort')."""
        now = time.monotonic()
        results = []
        parents: dict[str, ParentRequest] = {}
        for req_id in self.core_request_ids(request_ids):
            state = self.states.pop(req_id, None)
            if state is None:
                continue
            if stats is not None:
                queued = (state.first_token_time or now) - state.arrival_time
                stats.finished_requests.append(FinishedRequestStats(
                    "abort", now - state.arrival_time, queued, len(state.prompt_token_ids), len(state.token_ids)))
            self._emit(state, "abort", None, 0, results, parents)
        results.extend(self._parent_outputs(parents))
        return results

    def process(self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None) -> ProcessedOutputs:
        """Fold the engine's new tokens into each request's output; `stats` (if given) gains this
        iteration's token counts and latencies."""
        if self.pooling:
            return self._process_pooled(outputs, stats)
        results: list[RequestOutput] = []
        reqs_to_abort: list[str] = []
        parents: dict[str, ParentRequest] = {}
        now = time.monotonic()
        for out in outputs:
            state = self.states.get(out.req_id)
            if state is None:
                continue
            new_token_ids, finish_reason, stop_reason = out.new_token_ids, out.finish_reason, out.stop_reason
            if state.detokenizer is not None:
                num_taken, stop_string = state.detokenizer.update(new_token_ids)
                new_token_ids = new_token_ids[:num_taken]
                if stop_string is not None:
                    if finish_reason is None:
                        reqs_to_abort.append(out.req_id)
                    finish_reason, stop_reason = "stop", stop_string
                elif finish_reason is not None:
                    state.detokenizer.finish()
            if stats is not None:
                self._record(stats, state, out, len(new_token_ids), finish_reason, now)
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            state.token_ids.extend(new_token_ids)
            if state.logprobs is not None:
                state.logprobs.update(out, len(new_token_ids))
            if finish_reason is not None:
                del self.states[out.req_id]
            elif state.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue  # nothing to report before the end (to the caller or to a parent)
            self._emit(state, finish_reason, stop_reason, out.num_cached_tokens, results, parents,
                       out.kv_transfer_params)
        results.extend(self._parent_outputs(parents))
        return ProcessedOutputs(results, reqs_to_abort)

    def _process_pooled(self, outputs: list[EngineCoreOutput], stats: IterationStats | None) -> ProcessedOutputs:
        """Each output of the pooling runner is a request's end, with its vector."""
        results: list[RequestOutput | EmbeddingRequestOutput] = []
        now = time.monotonic()
        for out in outputs:
            state = self.states.pop(out.req_id, None)
            if state is None:
                continue
            if stats is not None:
                num_prompt_tokens = len(state.prompt_token_ids)
                stats.num_prompt_tokens += num_prompt_tokens
                scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else state.arrival_time
                stats.finished_requests.append(FinishedRequestStats(
                    out.finish_reason or "stop", now - state.arrival_time, scheduled - state.arrival_time,
                    num_prompt_tokens, 0))
            embedding = np.frombuffer(out.pooled or b"", dtype="<f4").tolist()
            results.append(EmbeddingRequestOutput(state.request_id, EmbeddingOutput(embedding),
                                                  state.prompt_token_ids, True))
        return ProcessedOutputs(results, [])

    def _emit(self, state: _RequestState, finish_reason: str | None, stop_reason: int | str | None,
              num_cached_tokens: int, results: list[RequestOutput], parents: dict[str, ParentRequest],
              kv_transfer_params: dict | None = None) -> None:
        """Report the state's new output: to the caller, or to its parent (collected in `parents`)."""
        completion = self._completion(state, finish_reason, stop_reason)
        if state.parent is not None:
            state.parent.add(completion, num_cached_tokens, state.first_token_time,
                             None if state.logprobs is None else state.logprobs.prompt_logprobs)
            parents[state.parent.request_id] = state.parent
            return
        record = state.record  # read directly, not through the properties: once per output of every step
        metrics = {"arrival_time": record.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if finish_reason is not None:
            metrics["finished_time"] = time.monotonic()
        results.append(RequestOutput(record.request_id, state.prompt, record.prompt_token_ids, [completion],
                                     finish_reason is not None, num_cached_tokens, metrics,
                                     None if state.logprobs is None else state.logprobs.prompt_logprobs,
                                     kv_transfer_params))

    @staticmethod
    def _completion(state: _RequestState, finish_reason: str | None,
                    stop_reason: int | str | None) -> CompletionOutput:
        """The sequence as its output kind reports it now (`process` never asks an unfinished
        FINAL_ONLY sequence)."""
        finished = finish_reason is not None
        delta = state.sampling_params.output_kind == RequestOutputKind.DELTA
        text = state.detokenizer.next_text(finished, delta) if state.detokenizer is not None else ""
        start = state.num_sent_tokens if delta else 0
        token_ids = state.token_ids[start:]
        state.num_sent_tokens = len(state.token_ids)
        lp = state.logprobs
        return CompletionOutput(state.index, text, token_ids,
                                cumulative_logprob=None if lp is None else lp.cumulative_logprob,
                                logprobs=None if lp is None else lp.sample_logprobs(start),
                                finish_reason=finish_reason, stop_reason=stop_reason)

    def _parent_outputs(self, parents: dict[str, ParentRequest]) -> list[RequestOutput]:
        results = []
        for parent in parents.values():
            output = parent.take_output()
            if output is not None:
                results.append(output)
            if parent.finished:
                del self.parents[parent.request_id]
        return results

    @staticmethod
    def _record(stats: IterationStats, state: _RequestState, out: EngineCoreOutput, num_new_tokens: int,
                finish_reason: str | None, now: float) -> None:
        stats.num_generation_tokens += num_new_tokens
        if state.first_token_time is None:
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            stats.time_to_first_tokens.append(now - state.arrival_time)
        else:
            stats.inter_token_latencies.append(now - state.last_token_time)
        if finish_reason is not None:
            scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else state.arrival_time
            stats.finished_requests.append(FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=now - state.arrival_time,
                queued_time=scheduled - state.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(state.token_ids) + num_new_tokens,
            ))
