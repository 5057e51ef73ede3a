"""The response cache: an exact match on the normalised request, for deterministic requests.

The key hashes the route, whether the answer streams, the API key's name (unless the cache is
shared across keys) and the body with keys sorted (every sampling field counts; `user` does not).
An entry holds the status, the content type and the body bytes; a streamed response is stored as
the SSE bytes it sent and replayed as a stream.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pagellm.router.body import is_deterministic
from pagellm.router.config import CacheConfig
from pagellm.router.store import Store

IGNORED_FIELDS = ("user", "stream")
"""Fields that do not change the answer's content (`stream` goes into the key on its own)."""
BYPASS_HEADER = "x-pagellm-cache-bypass"
STATUS_HEADER = "x-pagellm-cache"


@dataclass(slots=True, frozen=True)
class CachedResponse:
    status: int
    content_type: str
    body: bytes

    def encode(self) -> bytes:
        return json.dumps({"status": self.status, "content_type": self.content_type}).encode() + b"\n" + self.body

    @classmethod
    def decode(cls, data: bytes) -> CachedResponse:
        head, _, body = data.partition(b"\n")
        meta = json.loads(head)
        return cls(meta["status"], meta["content_type"], body)


class ResponseCache:
    def __init__(self, config: CacheConfig, store: Store) -> None:
        self.config = config
        self.store = store

    def key(self, path: str, body: dict[str, Any], key_name: str | None) -> str | None:
        """The cache key of a request, or None when it may not be cached."""
        if not self.config.enabled or (self.config.deterministic_only and not is_deterministic(body)):
            return None
        scope = "shared" if self.config.shared_across_keys or key_name is None else f"key={key_name}"
        normal = {k: v for k, v in body.items() if k not in IGNORED_FIELDS and v is not None}
        text = json.dumps([path, bool(body.get("stream")), scope, normal], sort_keys=True, separators=(",", ":"))
        return "cache:" + hashlib.sha256(text.encode()).hexdigest()

    async def get(self, key: str) -> CachedResponse | None:
        data = await self.store.get(key)
        return None if data is None else CachedResponse.decode(data)

    async def put(self, key: str, response: CachedResponse) -> None:
        if response.status == 200 and len(response.body) <= self.config.max_entry_bytes:
            await self.store.set(key, response.encode(), self.config.ttl_s)
