"""Output processing: incremental detokenization and RequestOutput assembly, per request."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagellm.core.outputs import EngineCoreOutput
from pagellm.metrics.stats import FinishedRequestStats, IterationStats
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.tokenizer import Tokenizer


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    skip_special_tokens: bool
    decoder: object | None
    arrival_time: float
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_time: float | None = None
    last_token_time: float | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    skip_special_tokens: bool, arrival_time: float) -> None:
        decoder = self.tokenizer.decode_stream(skip_special_tokens) if self.tokenizer else None
        self.states[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, skip_special_tokens, decoder, arrival_time)

    def abort(self, request_ids: list[str], stats: IterationStats | None = None) -> list[RequestOutput]:
        """Forget aborted requests; returns their final outputs (finish_reason 'abort')."""
        outs = []
        now = time.monotonic()
        for req_id in request_ids:
            state = self.states.pop(req_id, None)
            if state is None:
                continue
            outs.append(self._make_output(state, "abort", None, True, 0))
            if stats is not None:
                queued = (state.first_token_time or now) - state.arrival_time
                stats.finished_requests.append(FinishedRequestStats(
                    "abort", now - state.arrival_time, queued, len(state.prompt_token_ids), len(state.token_ids)))
        return outs

    def process(self, outputs: list[EngineCoreOutput], stats: IterationStats | None = None) -> list[RequestOutput]:
        """Fold the engine's new tokens into each request's output; `stats` (if given) gains this
        iteration's token counts and latencies."""
        results = []
        now = time.monotonic()
        for out in outputs:
            state = self.states.get(out.req_id)
            if state is None:
                continue
            if stats is not None:
                self._record(stats, state, out, now)
            if state.first_token_time is None:
                state.first_token_time = now
            state.last_token_time = now
            for token_id in out.new_token_ids:
                state.token_ids.append(token_id)
                if state.decoder is not None:
                    piece = state.decoder.step(self.tokenizer.backend, token_id)
                    if piece:
                        state.text += piece
            finished = out.finish_reason is not None
            if finished:
                del self.states[out.req_id]
            results.append(self._make_output(state, out.finish_reason, out.stop_reason, finished,
                                             out.num_cached_tokens))
        return results

    @staticmethod
    def _record(stats: IterationStats, state: _RequestState, out: EngineCoreOutput, now: float) -> None:
        stats.num_generation_tokens += len(out.new_token_ids)
        if state.first_token_time is None:
            stats.num_prompt_tokens += len(state.prompt_token_ids)
            stats.time_to_first_tokens.append(now - state.arrival_time)
        else:
            stats.inter_token_latencies.append(now - state.last_token_time)
        if out.finish_reason is not None:
            scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else state.arrival_time
            stats.finished_requests.append(FinishedRequestStats(
                finish_reason=out.finish_reason,
                e2e_latency=now - state.arrival_time,
                queued_time=scheduled - state.arrival_time,
                num_prompt_tokens=len(state.prompt_token_ids),
                num_generation_tokens=len(state.token_ids) + len(out.new_token_ids),
            ))

    @staticmethod
    def _make_output(state: _RequestState, finish_reason: str | None, stop_reason: int | str | None,
                     finished: bool, num_cached_tokens: int) -> RequestOutput:
        completion = CompletionOutput(0, state.text, list(state.token_ids),
                                      finish_reason=finish_reason, stop_reason=stop_reason)
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        if finished:
            metrics["finished_time"] = time.monotonic()
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion],
                             finished, num_cached_tokens, metrics)
