"""Per-API-key rate limits: requests, input tokens and output tokens per minute, and requests in flight.

Counters are per fixed one-minute window (`<key name>:<kind>:<minute>`), kept in the store (Redis:
shared by router replicas and kept across restarts). A request is admitted only if every limit
has room; the counters it already took are given back when another limit refuses it. Output tokens
are known only at the end: a key over its output budget is refused until the window turns.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from pagellm.router.config import KeyConfig
from pagellm.router.store import Store

WINDOW_S = 60
CONCURRENCY_TTL_S = 3600
"""A crashed router's in-flight count expires after this (Redis), so a key is not locked out for good."""


@dataclass(slots=True, frozen=True)
class Throttle:
    """Why a request is refused (429) and when to retry."""

    limit: str
    """The KeyConfig field that refused it."""
    retry_after_s: int

    def message(self, key: KeyConfig) -> str:
        return (f"rate limit exceeded for key {key.name!r}: {self.limit} = {getattr(key, self.limit)}; "
                f"retry after {self.retry_after_s} s")


class RateLimiter:
    def __init__(self, store: Store) -> None:
        self.store = store

    async def admit(self, key: KeyConfig, input_tokens: int) -> Throttle | None:
        """Take this request's share of every limit of `key`, or none of it and the Throttle."""
        now = time.time()
        window = int(now // WINDOW_S)
        retry = max(1, math.ceil((window + 1) * WINDOW_S - now))
        taken: list[tuple[str, int, float]] = []

        async def take(name: str, amount: int, limit: int | None, ttl: float) -> bool:
            if limit is None:
                return True
            value = await self.store.add(name, amount, ttl)
            taken.append((name, amount, ttl))
            return value <= limit

        checks = (
            ("max_concurrent", f"{key.name}:concurrent", 1, key.max_concurrent, CONCURRENCY_TTL_S, 1),
            ("requests_per_minute", f"{key.name}:requests:{window}", 1, key.requests_per_minute, WINDOW_S, retry),
            ("input_tokens_per_minute", f"{key.name}:input:{window}", input_tokens, key.input_tokens_per_minute,
             WINDOW_S, retry),
        )
        for limit_name, counter, amount, limit, ttl, retry_after in checks:
            if not await take(counter, amount, limit, ttl):
                await self._give_back(taken)
                return Throttle(limit_name, retry_after)
        if key.output_tokens_per_minute is not None:
            used = await self.store.get_count(f"{key.name}:output:{window}")
            if used >= key.output_tokens_per_minute:
                await self._give_back(taken)
                return Throttle("output_tokens_per_minute", retry)
        return None

    async def release(self, key: KeyConfig, output_tokens: int) -> None:
        """The request admitted by `admit` ended having produced `output_tokens`."""
        if key.max_concurrent is not None:
            await self.store.add(f"{key.name}:concurrent", -1, CONCURRENCY_TTL_S)
        if key.output_tokens_per_minute is not None and output_tokens:
            window = int(time.time() // WINDOW_S)
            await self.store.add(f"{key.name}:output:{window}", output_tokens, WINDOW_S)

    async def _give_back(self, taken: list[tuple[str, int, float]]) -> None:
        for name, amount, ttl in taken:
            await self.store.add(name, -amount, ttl)
