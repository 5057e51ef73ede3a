"""Offline beam search (vLLM's `LLM.beam_search`), with Hugging Face's selection rules.

Each step asks the engine for the top-k next-token logprobs of every running beam (one-token
requests); beams share their prompt and common prefix through the prefix cache, so a beam's KV is
only recomputed for its last, partial block. Candidate selection, finished-hypothesis scoring
(cumulative logprob / generated_length ** length_penalty) and the stopping heuristic follow
`transformers`' beam search with `early_stopping=False`, so greedy beam search gives the same
tokens as `generate(num_beams=W, do_sample=False)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One hypothesis: prompt plus generated tokens, as in vLLM."""

    tokens: list[int]
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)
    """The logprob of each generated token."""
    text: str | None = None
    finish_reason: str | None = None
    score: float = _NEG_INF
    """cum_logprob / generated_length ** length_penalty, once finished."""


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """The beam_width best hypotheses, best first."""


@dataclass(slots=True)
class _PromptSearch:
    """The state of one prompt's search."""

    prompt_len: int
    running: list[BeamSearchSequence]
    finished: list[BeamSearchSequence] = field(default_factory=list)
    done: bool = False


def beam_search(engine: LLMEngine, prompts: list[list[int]], params: BeamSearchParams,
                eos_token_ids: frozenset[int]) -> list[BeamSearchOutput]:
    width = params.beam_width
    # As transformers: keep enough candidates that `width` survive even if some hit EOS.
    num_candidates = max(2, 1 + len(eos_token_ids)) * width
    max_logprobs = engine.config.model.max_logprobs
    if num_candidates > max_logprobs:
        raise ValueError(f"beam_width {width} needs {num_candidates} logprobs per step but max_logprobs is "
                         f"{max_logprobs}: lower beam_width or raise max_logprobs")
    step_params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=num_candidates, ignore_eos=True)
    searches = [_PromptSearch(len(p), [BeamSearchSequence(list(p))]) for p in prompts]
    for step in range(params.max_tokens):
        active = [s for s in searches if not s.done]
        if not active:
            break
        beams = [beam for s in active for beam in s.running]
        top = _next_token_logprobs(engine, [b.tokens for b in beams], step_params)
        offset = 0
        for search in active:
            beam_tops = top[offset:offset + len(search.running)]
            offset += len(search.running)
            _advance(search, beam_tops, step + 1, step + 1 == params.max_tokens, num_candidates, params,
                     eos_token_ids)
    tokenizer = engine.tokenizer
    outputs = []
    for search in searches:
        best = sorted(search.finished, key=lambda b: b.score, reverse=True)[:width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        outputs.append(BeamSearchOutput(best))
    return outputs


def _advance(search: _PromptSearch, beam_tops: list[list[tuple[int, float]]], generated_len: int, at_limit: bool,
             num_candidates: int, params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
    width = params.beam_width
    candidates = sorted(
        ((beam.cum_logprob + lp, i, token, lp) for i, (beam, top) in enumerate(zip(search.running, beam_tops))
         for token, lp in top),
        key=lambda c: c[0], reverse=True)[:num_candidates]
    next_running: list[BeamSearchSequence] = []
    for rank, (cum, i, token, lp) in enumerate(candidates):
        parent = search.running[i]
        child = BeamSearchSequence(parent.tokens + [token], cum, parent.logprobs + [lp])
        stops = at_limit or (not params.ignore_eos and token in eos_token_ids)
        if stops:
            # Only candidates among the top `width` may finish (transformers' rule).
            if rank < width:
                child.finish_reason = "length" if at_limit and token not in eos_token_ids else "stop"
                child.score = cum / (generated_len ** params.length_penalty)
                search.finished.append(child)
        elif len(next_running) < width:
            next_running.append(child)
    search.finished = sorted(search.finished, key=lambda b: b.score, reverse=True)[:width]
    search.running = next_running
    if at_limit or not next_running:
        search.done = True
    elif len(search.finished) == width:
        # Stop once the best running beam, scored at its current length, cannot beat the worst
        # finished hypothesis.
        best_possible = next_running[0].cum_logprob / (generated_len ** params.length_penalty)
        search.done = best_possible <= search.finished[-1].score


def _next_token_logprobs(engine: LLMEngine, token_lists: list[list[int]],
                         params: SamplingParams) -> list[list[tuple[int, float]]]:
    """For each token list, the top next tokens as (token id, logprob), best first."""
    ids = []
    for tokens in token_lists:
        request_id = f"beam-{engine.next_request_id()}"
        engine.add_request(request_id, {"prompt_token_ids": tokens}, params)
        ids.append(request_id)
    results = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out.outputs[0].logprobs[0]
    return [sorted(((t, lp.logprob) for t, lp in results[i].items()), key=lambda x: x[1], reverse=True)
            for i in ids]
