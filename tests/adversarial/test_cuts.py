"""Clients that leave at random points (seeded): after a few events of a stream, in the middle of an event
(a random byte), before the response's headers (while the request waits for room, is tokenized or
prefills), or while a plain request generates; on every generation route, a few at a time on the
adversary server's small capacity. Afterwards nothing is running, waiting or admitted, no KV block is
held, the log shows no fault, and the server serves normally. (tests/test_storms.py cuts completions and
chat streams after random numbers of events on a cache that keeps preempting.)"""
from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from adversarial.probes import AUTH, ROUTES, assert_serves_normally, server_faults, wait_settled

pytestmark = pytest.mark.slow  # the shared adversary server (conftest.py)

SEED = 5301
NUM_CUTS = 48
AT_ONCE = 6
"""Cut requests in flight at once: some of them wait for room (8 sequences admitted)."""
CUTS = ("after_events", "mid_event", "before_headers", "plain")
TIMEOUT_S = 60.0


def long_request(rng: random.Random, stream: bool) -> tuple[str, dict]:
    """A request on a random route that generates long enough to be cut while it runs."""
    path = rng.choice(sorted(ROUTES))
    body = {**ROUTES[path], "stream": stream, "temperature": 0.8}
    body["max_output_tokens" if path == "/v1/responses" else "max_tokens"] = rng.randint(32, 160)
    if path in ("/v1/completions", "/v1/chat/completions"):  # vLLM's extras: not on the other routes
        body.update(ignore_eos=True, n=rng.choice((1, 1, 2)), seed=rng.randint(0, 99))
    return path, body


async def cut(http: httpx.AsyncClient, rng: random.Random) -> str:
    """One request cut at a random point, drawn from `rng`; what happened (the point, or the answer that came
    before it)."""
    how = rng.choice(CUTS)
    path, body = long_request(rng, stream=how != "plain")
    if how in ("before_headers", "plain"):
        delay = rng.uniform(0.0, 1.5) if how == "before_headers" else rng.uniform(0.2, 3.0)
        try:
            response = await asyncio.wait_for(http.post(path, json=body), timeout=delay)
        except asyncio.TimeoutError:
            return how
        return f"{how}: answered {response.status_code} first"
    limit = rng.randint(1, 12) if how == "after_events" else rng.randint(1, 4000)
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return f"{how}: answered {response.status_code} first"
        seen = 0
        if how == "after_events":
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == limit:
                    return how
        else:
            async for chunk in response.aiter_raw():
                seen += len(chunk)
                if seen >= limit:
                    return how
    return f"{how}: the stream ended first"


def test_clients_cut_at_random_points_leave_nothing_behind(adversary):
    async def run() -> list[str]:
        rngs = [random.Random(SEED * 1000 + i) for i in range(NUM_CUTS)]
        room = asyncio.Semaphore(AT_ONCE)
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=adversary.url, headers=AUTH, timeout=TIMEOUT_S, limits=limits) as http:
            async def one(rng: random.Random) -> str:
                async with room:
                    return await cut(http, rng)

            return await asyncio.gather(*[one(rng) for rng in rngs])

    happened = asyncio.run(run())
    cuts = [h for h in happened if h in CUTS]
    assert len(cuts) >= NUM_CUTS // 2 and set(cuts) == set(CUTS), happened
    assert all(h in CUTS or "answered 200" in h or "answered 503" in h or "ended first" in h for h in happened), \
        happened
    wait_settled(adversary)
    assert_serves_normally(adversary, AUTH)
    assert not server_faults(adversary.log_tail(1_000_000))
