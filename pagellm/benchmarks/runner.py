"""The loop under `bench throughput` and `bench latency`: run a fixed set of requests through an engine
(greedy, EOS ignored, all queued at once, as `LLM.generate` does) and time what comes out.

A deadline turns a run that would take too long into a partial one: at the deadline the unfinished
requests are aborted and the result says it is incomplete, so the tokens made so far still count.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from pagellm.benchmarks.datasets import BenchRequest
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.llm import LLM
from pagellm.lora_request import LoRARequest
from pagellm.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class RequestTiming:
    """One request of a run."""

    prompt_tokens: int
    output_tokens: int = 0
    """Tokens generated (all of them unless the deadline aborted the request)."""
    first_token_s: float | None = None
    """Seconds from the start of the run to the first token; only with `token_times`."""
    token_gaps_s: list[float] | None = None
    """Seconds between consecutive tokens (one fewer than output_tokens); only with `token_times`."""
    last_token_at: float | None = None
    """perf_counter time of the latest token (bookkeeping for the gaps)."""
    finished: bool = False


@dataclass(slots=True)
class RunResult:
    elapsed_s: float
    """From queueing the first request to the last output (or the deadline)."""
    num_steps: int
    requests: list[RequestTiming]
    """In the order of the input requests."""
    complete: bool
    """False when the deadline stopped the run; the unfinished requests were aborted."""

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)


def engine_summary(llm: LLM) -> dict[str, Any]:
    """What the engine resolved its arguments to (device, dtype, backend, budgets, KV cache size)."""
    config = llm.llm_engine.config
    core = llm.llm_engine.engine_core
    return {
        "model": config.model.source.path,
        "load_format": config.model.source.load_format,
        "device": str(config.device),
        "dtype": str(config.model.dtype).removeprefix("torch."),
        "attention_backend": config.model.attention_backend,
        "enforce_eager": config.model.enforce_eager,
        "max_model_len": config.model.max_model_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "block_size": config.cache.block_size,
        "enable_prefix_caching": config.cache.enable_prefix_caching,
        "num_kv_blocks": core.num_blocks,
    }


def greedy_params(output_len: int, kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY) -> SamplingParams:
    """Exactly `output_len` greedy tokens: the sampling every benchmark here uses."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind=kind)


def run_requests(engine: LLMEngine, requests: Sequence[BenchRequest], *, token_times: bool = False,
                 deadline: float | None = None, progress: bool = False,
                 lora_requests: Sequence[LoRARequest | None] | None = None) -> RunResult:
    """Queue every request, step the engine until all finish (or `deadline`, a `time.perf_counter()`
    value, passes), and count tokens; with `token_times`, also each request's token arrival times.

    Without `token_times` only final outputs are built (as `LLM.generate` does), so the loop adds
    nothing per step that a user's call would not. `lora_requests`: each request's adapter.
    """
    kind = RequestOutputKind.DELTA if token_times else RequestOutputKind.FINAL_ONLY
    timings = {}
    start = time.perf_counter()
    for i, request in enumerate(requests):
        request_id = engine.next_request_id()
        engine.add_request(request_id, {"prompt_token_ids": request.prompt_token_ids},
                           greedy_params(request.output_len, kind),
                           lora_request=lora_requests[i] if lora_requests is not None else None)
        timings[request_id] = RequestTiming(len(request.prompt_token_ids), token_gaps_s=[] if token_times else None)
    unfinished = set(timings)
    num_steps = 0
    with tqdm(total=len(requests), desc="Requests", disable=not progress, dynamic_ncols=True) as bar:
        while engine.has_unfinished_requests():
            if deadline is not None and time.perf_counter() > deadline:
                _record(engine.abort_request(sorted(unfinished)), timings, unfinished, start, time.perf_counter())
                return RunResult(time.perf_counter() - start, num_steps, list(timings.values()), complete=False)
            outputs = engine.step()
            num_steps += 1
            bar.update(_record(outputs, timings, unfinished, start, time.perf_counter()))
    return RunResult(time.perf_counter() - start, num_steps, list(timings.values()), complete=True)


def _record(outputs: list, timings: dict[str, RequestTiming], unfinished: set[str], start: float, now: float) -> int:
    """Fold one step's outputs into the timings; returns how many requests finished."""
    finished = 0
    for out in outputs:
        timing = timings[out.request_id]
        new_tokens = len(out.outputs[0].token_ids)
        if timing.token_gaps_s is not None and new_tokens:
            if timing.last_token_at is None:
                timing.first_token_s = now - start
            else:
                timing.token_gaps_s.append(now - timing.last_token_at)
            # Several tokens in one output (none today) would arrive together: zero gaps after the first.
            timing.token_gaps_s.extend([0.0] * (new_tokens - 1))
            timing.last_token_at = now
        timing.output_tokens += new_tokens
        if out.finished:
            timing.finished = out.outputs[0].finish_reason != "abort"
            unfinished.discard(out.request_id)
            finished += 1
    return finished
