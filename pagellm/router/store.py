"""Where the router keeps state it shares: counters (rate limits) and cached responses, in this
process's memory or in Redis (shared by router replicas, kept across restarts).

A Redis that fails while running degrades to this process's memory with a logged warning (no
request fails for it); one that is unreachable at start-up is a start-up error (`check`).
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict

from pagellm.router.resp import RedisClient, RedisError

logger = logging.getLogger(__name__)
KEY_PREFIX = "pagellm:router:"
MEMORY_COUNTERS_PURGE_AT = 100_000
"""Expired counters are swept when this many are held (keys are per minute window)."""


class MemoryStore:
    """Counters with expiry and a least-recently-used response cache bounded by `max_entries`."""

    def __init__(self, max_entries: int = 10_000) -> None:
        self._counters: dict[str, tuple[int, float]] = {}
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()
        self.max_entries = max_entries

    async def add(self, key: str, amount: int, ttl_s: float) -> int:
        now = time.monotonic()
        value, expires = self._counters.get(key, (0, 0.0))
        if expires <= now:
            value, expires = 0, now + ttl_s
        self._counters[key] = (value + amount, expires)
        if len(self._counters) > MEMORY_COUNTERS_PURGE_AT:
            self._counters = {k: v for k, v in self._counters.items() if v[1] > now}
        return value + amount

    async def get_count(self, key: str) -> int:
        value, expires = self._counters.get(key, (0, 0.0))
        return value if expires > time.monotonic() else 0

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[1] <= time.monotonic():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry[0]

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        self._entries[key] = (value, time.monotonic() + ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def close(self) -> None:
        pass


class RedisStore:
    """The same operations on Redis; on a Redis error, this process's memory, with a warning."""

    def __init__(self, url: str, max_entries: int = 10_000) -> None:
        self.url = url
        self.client = RedisClient(url)
        self.fallback = MemoryStore(max_entries)
        self._warned = False

    async def check(self) -> None:
        """Raise ValueError naming `cache.url` when Redis does not answer (start-up)."""
        try:
            await self.client.execute("PING")
        except RedisError as e:
            raise ValueError(f"cache.url: {self.url} does not answer: {e}") from e

    def _degraded(self, e: RedisError) -> None:
        if not self._warned:  # once per outage, not once per request
            logger.warning("redis unavailable, using this process's memory for limits and cache: %s", e)
            self._warned = True

    def _ok(self) -> None:
        if self._warned:
            logger.warning("redis at %s is back", self.url)
            self._warned = False

    async def add(self, key: str, amount: int, ttl_s: float) -> int:
        try:
            value, _ = await self.client.pipeline([("INCRBY", KEY_PREFIX + key, amount),
                                                   ("EXPIRE", KEY_PREFIX + key, max(1, int(ttl_s)))])
        except RedisError as e:
            self._degraded(e)
            return await self.fallback.add(key, amount, ttl_s)
        self._ok()
        return int(value)

    async def get_count(self, key: str) -> int:
        try:
            value = await self.client.execute("GET", KEY_PREFIX + key)
        except RedisError as e:
            self._degraded(e)
            return await self.fallback.get_count(key)
        self._ok()
        return int(value or 0)

    async def get(self, key: str) -> bytes | None:
        try:
            value = await self.client.execute("GET", KEY_PREFIX + key)
        except RedisError as e:
            self._degraded(e)
            return await self.fallback.get(key)
        self._ok()
        return value if isinstance(value, bytes) else None

    async def set(self, key: str, value: bytes, ttl_s: float) -> None:
        try:
            await self.client.execute("SET", KEY_PREFIX + key, value, "PX", max(1, int(ttl_s * 1000)))
        except RedisError as e:
            self._degraded(e)
            await self.fallback.set(key, value, ttl_s)
            return
        self._ok()

    async def close(self) -> None:
        await self.client.close()


Store = MemoryStore | RedisStore


def make_store(url: str, max_entries: int) -> Store:
    return RedisStore(url, max_entries) if url.startswith("redis://") else MemoryStore(max_entries)
