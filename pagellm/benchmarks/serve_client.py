"""The load generator under `pagellm bench serve`: streamed OpenAI-API requests sent on a schedule
(all at once, Poisson or gamma arrivals), at most `max_concurrency` in flight, each timed token by token.

Works against any OpenAI-compatible server. Token counts come from the server's `usage` (asked for
with `stream_options.include_usage`), so they are the server's own counts; a server that sends no
usage gets its output counted by the client's tokenizer instead.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm.auto import tqdm

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
_CONNECT_TIMEOUT_S = 30.0
_READ_TIMEOUT_S = 600.0
"""Longest silence between two chunks of one stream before the request counts as failed."""


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it."""

    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    """From sending the request to the first content chunk."""
    itl_s: list[float] = field(default_factory=list)
    """Gaps between consecutive content chunks."""
    latency_s: float = 0.0
    """From sending the request to the end of its stream."""
    usage_from_server: bool = False
    generated_text: str = ""
    error: str = ""


@dataclass(slots=True)
class LoadResult:
    results: list[RequestResult]
    """In the order of the payloads."""
    duration_s: float
    """From the first request sent to the last stream closed."""
    peak_concurrency: int


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each request: none at an infinite rate, else gamma-distributed gaps
    with mean 1 / request_rate and shape `burstiness` (1: a Poisson process; below 1: burstier)."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(num)]


def request_payload(endpoint: str, model: str, prompt: str, max_tokens: int, ignore_eos: bool,
                    temperature: float) -> dict[str, Any]:
    """The JSON body of one streamed request to `endpoint`."""
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # vLLM's extra, which pagellm and SGLang accept too
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def run_load(url: str, payloads: Sequence[dict[str, Any]], gaps: Sequence[float], max_concurrency: int | None,
             headers: dict[str, str], progress: bool = True) -> LoadResult:
    """Send every payload to `url` after its gap, with at most `max_concurrency` in flight (None: no limit)."""
    return asyncio.run(_run_load(url, payloads, gaps, max_concurrency, headers, progress))


async def _run_load(url: str, payloads: Sequence[dict[str, Any]], gaps: Sequence[float],
                    max_concurrency: int | None, headers: dict[str, str], progress: bool) -> LoadResult:
    slots = asyncio.Semaphore(max_concurrency or len(payloads))
    in_flight = peak = 0
    # One connection per request that may be in flight: a pool smaller than the load would queue
    # requests in the client and hide the server's own queueing.
    limits = httpx.Limits(max_connections=max_concurrency or len(payloads), max_keepalive_connections=None)
    timeout = httpx.Timeout(_CONNECT_TIMEOUT_S, read=_READ_TIMEOUT_S)
    with tqdm(total=len(payloads), desc="Requests", disable=not progress, dynamic_ncols=True) as bar:
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:

            async def one(payload: dict[str, Any]) -> RequestResult:
                nonlocal in_flight, peak
                async with slots:
                    in_flight += 1
                    peak = max(peak, in_flight)
                    try:
                        return await send_streamed(client, url, payload)
                    finally:
                        in_flight -= 1
                        bar.update(1)

            start = time.perf_counter()
            tasks = []
            for payload, gap in zip(payloads, gaps):
                if gap > 0:
                    await asyncio.sleep(gap)  # the arrival schedule itself
                tasks.append(asyncio.create_task(one(payload)))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    return LoadResult(list(results), duration, peak)


async def send_streamed(client: httpx.AsyncClient, url: str, payload: dict[str, Any]) -> RequestResult:
    """One streamed request; failures (HTTP errors, error events, broken streams) are recorded, not raised."""
    result = RequestResult()
    text_of = _chat_text if "messages" in payload else _completion_text
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                data = line.removeprefix("data:").strip() if line.startswith("data:") else ""
                if not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
                    return result
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
                    result.usage_from_server = True
                text = text_of(chunk)
                if text:
                    now = time.perf_counter()
                    if result.generated_text:
                        result.itl_s.append(now - last)
                    else:
                        result.ttft_s = now - start
                    last = now
                    result.generated_text += text
    except (httpx.HTTPError, ValueError, TypeError, AttributeError) as e:  # also malformed chunks
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency_s = time.perf_counter() - start
    if not result.generated_text:  # nothing visible came back (all special tokens, say): the end is the first
        result.ttft_s = result.latency_s
    result.success = True
    return result


def fill_missing_counts(results: Sequence[RequestResult], prompt_lens: Sequence[int],
                        count_tokens: Callable[[str], int]) -> None:
    """For a server that sent no usage: the dataset's prompt length and the client's token count of
    the generated text."""
    for result, prompt_len in zip(results, prompt_lens):
        if result.success and not result.usage_from_server:
            result.prompt_tokens = prompt_len
            result.output_tokens = count_tokens(result.generated_text)


def _completion_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    return (choices[0].get("text") or "") if choices else ""


def _chat_text(chunk: dict[str, Any]) -> str:
    """The delta's text: a reasoning model's first tokens are reasoning, and they count for TTFT."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return (delta.get("reasoning_content") or delta.get("reasoning") or "") + (delta.get("content") or "")
