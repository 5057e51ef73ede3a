"""Parallel sampling (n > 1, best_of): one request fanned out into independent child requests.

The children share the prompt token ids, so with prefix caching the prompt's full KV blocks are
computed and stored once and each child holds only its own partial and generated blocks. The
scheduler and workers see ordinary requests; only the API process knows they belong together.
"""
from __future__ import annotations

import dataclasses
import time

import msgspec

from pagellm.core.request import EngineCoreRequest, RecordFields
from pagellm.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from pagellm.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(index: int, parent_id: str) -> str:
    return f"{index}_{parent_id}"


class ParentRequest(RecordFields):
    """Gathers the children's completions into the parent's RequestOutputs (`outputs[i].index == i`)."""

    __slots__ = ("record", "prompt", "n", "output_kind", "child_ids", "_latest", "_new", "_unfinished",
                 "_first_token_time", "_num_cached_tokens", "_prompt_logprobs", "_logprobs_wanted")

    def __init__(self, record: EngineCoreRequest, prompt: str | None) -> None:
        params = record.sampling_params
        self.record = record
        self.prompt = prompt
        self.n = params.n
        # Which best_of children are returned is only known at the end: nothing streams before it.
        self.output_kind = RequestOutputKind.FINAL_ONLY if _num_children(params) > params.n else params.output_kind
        self.child_ids = [child_request_id(i, record.request_id) for i in range(_num_children(params))]
        self._latest: list[CompletionOutput | None] = [None] * len(self.child_ids)
        self._new: dict[int, CompletionOutput] = {}
        self._unfinished = set(range(len(self.child_ids)))
        self._first_token_time: float | None = None
        self._num_cached_tokens = 0
        self._prompt_logprobs: PromptLogprobs | None = None
        self._logprobs_wanted = params.logprobs is not None

    def make_children(self) -> list[EngineCoreRequest]:
        """The children's records: the parent's, each with its own id and params (resolved params
        copied with n=1; seed + i when seeded); every other field is the parent's."""
        return [msgspec.structs.replace(self.record, request_id=child_id,
                                        sampling_params=child_params(self.record.sampling_params, i, self.output_kind))
                for i, child_id in enumerate(self.child_ids)]

    def add(self, completion: CompletionOutput, num_cached_tokens: int, first_token_time: float | None,
            prompt_logprobs: PromptLogprobs | None = None) -> None:
        """Take one child's completion (cumulative or delta, as the child's output kind says)."""
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs
        index = completion.index
        self._latest[index] = completion
        self._new[index] = completion
        if completion.finished():
            self._unfinished.discard(index)
        self._num_cached_tokens = max(self._num_cached_tokens, num_cached_tokens)
        if first_token_time is not None and (self._first_token_time is None or first_token_time < self._first_token_time):
            self._first_token_time = first_token_time

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def take_output(self) -> RequestOutput | None:
        """The parent's output after the children's latest completions; None when there is nothing
        to report (FINAL_ONLY before the end, or no delta)."""
        finished = self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            outputs = self._best()
        elif self.output_kind == RequestOutputKind.DELTA:
            if not self._new:
                return None
            outputs = [self._new[i] for i in sorted(self._new)]
        else:
            outputs = [c if c is not None else CompletionOutput(i, "", []) for i, c in enumerate(self._latest)]
        self._new.clear()
        metrics = {"arrival_time": self.record.arrival_time}
        if self._first_token_time is not None:
            metrics["first_token_time"] = self._first_token_time
        if finished:
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, finished,
                             self._num_cached_tokens, metrics, self._prompt_logprobs)

    def _best(self) -> list[CompletionOutput]:
        """All n completions; with best_of, the n of highest cumulative logprob, best first and
        re-indexed 0..n-1 (per-token logprobs dropped unless the request asked for them)."""
        completions = [c for c in self._latest if c is not None]
        if len(completions) == self.n:
            return completions
        ranked = sorted(completions, key=_rank_key, reverse=True)[:self.n]
        return [dataclasses.replace(c, index=i, logprobs=c.logprobs if self._logprobs_wanted else None)
                for i, c in enumerate(ranked)]


def _rank_key(completion: CompletionOutput) -> float:
    # An aborted child may have no logprob yet: it ranks last.
    return completion.cumulative_logprob if completion.cumulative_logprob is not None else float("-inf")


def needs_fan_out(params: SamplingParams) -> bool:
    return _num_children(params) > 1


def _num_children(params: SamplingParams) -> int:
    return params.best_of if params.best_of is not None else params.n


def child_params(params: SamplingParams, index: int, output_kind: RequestOutputKind) -> SamplingParams:
    """One child's params: a single sequence; a distinct seed so seeded children differ yet repeat.
    best_of ranks by cumulative logprob, so its children always compute the sampled token's."""
    ranked = _num_children(params) > params.n
    return dataclasses.replace(
        params, n=1, best_of=None, output_kind=output_kind,
        seed=params.seed + index if params.seed is not None else None,
        logprobs=0 if ranked and params.logprobs is None else params.logprobs,
    )
