"""Overload with bounded concurrency: four times more clients than the adversary server admits and lets
wait (8 sequences in flight, 8 requests waiting, probes.ADMISSION_FLAGS), each sending one request after
another on every generation route, streamed or not, for a few seconds. Every answer is a complete 200 or a
503 with `Retry-After` in the route's error shape: at once when the queue is full, after the 3 s queue
timeout otherwise; no request hangs, /health stays fast, the turned-away counters match the 503s, and
the server settles. (tests/test_server_reliability.py bursts one route at 10x capacity; tests/
test_admission.py checks the admission rules one by one.)"""
from __future__ import annotations

import asyncio
import random
import statistics

import httpx
import pytest
from server_utils import health_latencies, metric_samples

from adversarial.probes import (
    AUTH,
    ERROR,
    MAX_NUM_SEQS,
    OK,
    QUEUE_TIMEOUT_S,
    ROUTES,
    SEQS_IN_FLIGHT,
    WAITING_REQUESTS,
    Outcome,
    assert_serves_normally,
    request_outcome,
    server_faults,
    wait_settled,
)

pytestmark = pytest.mark.slow  # the shared adversary server (conftest.py)

NUM_CLIENTS = 4 * (SEQS_IN_FLIGHT + WAITING_REQUESTS)
DURATION_S = 8.0
SEED = 53
AT_ONCE_P50_S, AT_ONCE_S = 0.1, 2.0
"""A 503 for a full queue needs no waiting: half come within 0.1 s, and all within 2 s even when dozens of
clients retry in the same instant (Retry-After: 1) on two shared cores."""
ANSWER_S = QUEUE_TIMEOUT_S + 30.0
"""The longest any request may take: its wait for room, then up to 24 tokens on a shared CPU."""
HEALTH_P50_S, HEALTH_MAX_S = 0.1, 1.0
TURNED_AWAY = ("pagellm:http_requests_turned_away_total{at_capacity}",
               "pagellm:http_requests_turned_away_total{queue_timeout}")


def request(rng: random.Random) -> tuple[str, dict]:
    """(route, body): a generation route, streamed or not, 4 to 24 tokens, sometimes two sequences."""
    path = rng.choice(sorted(ROUTES))
    body = {**ROUTES[path], "stream": rng.random() < 0.5}
    tokens = rng.randint(4, 24)
    body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = tokens
    if path in ("/v1/completions", "/v1/chat/completions") and rng.random() < 0.3:
        body["n"] = 2
    return path, body


async def client(http: httpx.AsyncClient, rng: random.Random, deadline: float,
                 outcomes: list[tuple[str, Outcome]]) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        path, body = request(rng)
        outcome = await request_outcome(http, path, body)
        outcomes.append((path, outcome))
        if outcome.retry_after is not None:  # as the openai client does before it retries
            await asyncio.sleep(float(outcome.retry_after))


def test_overload_gets_answers_or_prompt_503s_and_nothing_hangs(adversary):
    before = metric_samples(adversary.url)

    async def run() -> list[tuple[str, Outcome]]:
        outcomes: list[tuple[str, Outcome]] = []
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=adversary.url, headers=AUTH, timeout=ANSWER_S, limits=limits) as http:
            deadline = asyncio.get_running_loop().time() + DURATION_S
            await asyncio.gather(*[client(http, random.Random(SEED * 1000 + i), deadline, outcomes)
                                   for i in range(NUM_CLIENTS)])
        return outcomes

    with health_latencies(adversary.url) as latencies:
        outcomes = asyncio.run(run())
    wrong = [(path, o) for path, o in outcomes if o.kind not in (OK, ERROR) or (o.kind == ERROR and (
        o.code != 503 or o.retry_after != "1"))]
    assert not wrong, wrong[:5]
    refused = [o for _, o in outcomes if o.kind == ERROR]
    full = [o for o in refused if "at capacity" in o.detail]
    waited = [o for o in refused if "--queue-timeout" in o.detail]
    assert len(full) + len(waited) == len(refused), [o.detail for o in refused if o not in full + waited][:3]
    assert full and sum(o.kind == OK for _, o in outcomes) >= MAX_NUM_SEQS, "the run did not overload the server"
    assert statistics.median(o.elapsed_s for o in full) < AT_ONCE_P50_S
    assert max(o.elapsed_s for o in full) < AT_ONCE_S
    assert all(QUEUE_TIMEOUT_S <= o.elapsed_s < QUEUE_TIMEOUT_S + AT_ONCE_S for o in waited), \
        [round(o.elapsed_s, 2) for o in waited]
    assert max(o.elapsed_s for _, o in outcomes) < ANSWER_S
    assert statistics.median(latencies) < HEALTH_P50_S and max(latencies) < HEALTH_MAX_S, \
        f"/health p50 {statistics.median(latencies):.3f} s, max {max(latencies):.3f} s"
    after = wait_settled(adversary)
    assert sum(after[name] - before[name] for name in TURNED_AWAY) == len(refused)
    assert_serves_normally(adversary, AUTH)
    assert not server_faults(adversary.log_tail(1_000_000))
