"""The router's response cache: deterministic requests answered again byte for byte without a
backend (streamed ones replayed as a stream), per API key, bypassed on request, bounded."""
from __future__ import annotations

import asyncio

import httpx
import openai

from pagellm.router.store import MemoryStore

KEYS = [{"key": "ka", "name": "a"}, {"key": "kb", "name": "b"}]


def _post(http: httpx.Client, body: dict, key: str | None = None, **headers: str) -> httpx.Response:
    if key:
        headers["authorization"] = f"Bearer {key}"
    return http.post("/v1/chat/completions" if "messages" in body else "/v1/completions", json=body, headers=headers)


def test_deterministic_request_hits_and_never_reaches_the_backend(fakes, router) -> None:
    a = fakes("a")
    r = router({"models": [{"name": "m", "backends": [a.url]}]})
    with httpx.Client(base_url=r.url) as http:
        for body in ({"model": "m", "prompt": "hi", "temperature": 0},
                     {"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": 7},
                     {"model": "m", "prompt": "hi", "temperature": 0, "stream": True}):
            before = len(a.bodies)
            first, second = _post(http, body), _post(http, body)
            assert first.headers["x-pagellm-cache"] == "miss" and second.headers["x-pagellm-cache"] == "hit"
            assert second.content == first.content
            assert second.headers["content-type"] == first.headers["content-type"]
            assert len(a.bodies) == before + 1
    assert r.state.metrics.cache.labels("m", "hit")._value.get() == 3


def test_streamed_hit_replays_as_a_stream_through_the_sdk(fakes, router) -> None:
    a = fakes("a", stream_events=3)
    r = router({"models": [{"name": "m", "backends": [a.url]}]})
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused")
    runs = [[c.choices[0].delta.content for c in client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], temperature=0, stream=True)] for _ in range(2)]
    assert runs[0] == runs[1] == [f"a:1:{i} " for i in range(3)]
    assert len(a.bodies) == 1


def test_not_cached_when_sampling_bypassed_or_different(fakes, router) -> None:
    a = fakes("a")
    r = router({"models": [{"name": "m", "backends": [a.url]}]})
    with httpx.Client(base_url=r.url) as http:
        sampled = {"model": "m", "prompt": "hi", "temperature": 0.7}
        assert "x-pagellm-cache" not in _post(http, sampled).headers
        _post(http, sampled)
        greedy = {"model": "m", "prompt": "hi", "temperature": 0}
        _post(http, greedy)
        assert "x-pagellm-cache" not in _post(http, greedy, **{"x-pagellm-cache-bypass": "1"}).headers
        assert _post(http, {**greedy, "max_tokens": 3}).headers["x-pagellm-cache"] == "miss"  # every field counts
        assert _post(http, {**greedy, "user": "someone"}).headers["x-pagellm-cache"] == "hit"  # not `user`
    assert len(a.bodies) == 5


def test_never_across_keys_unless_shared(fakes, router) -> None:
    a = fakes("a")
    body = {"model": "m", "prompt": "hi", "temperature": 0}
    private = router({"models": [{"name": "m", "backends": [a.url]}], "keys": KEYS})
    shared = router({"models": [{"name": "m", "backends": [a.url]}], "keys": KEYS,
                     "cache": {"shared_across_keys": True}})
    with httpx.Client(base_url=private.url) as http:
        assert [_post(http, body, k).headers["x-pagellm-cache"] for k in ("ka", "kb", "kb")] == ["miss", "miss", "hit"]
    with httpx.Client(base_url=shared.url) as http:
        assert [_post(http, body, k).headers["x-pagellm-cache"] for k in ("ka", "kb")] == ["miss", "hit"]


def test_errors_and_disabled_cache_are_not_stored(fakes, router) -> None:
    a = fakes("a", status=400)
    r = router({"models": [{"name": "m", "backends": [a.url]}]})
    off = router({"models": [{"name": "m", "backends": [a.url]}], "cache": {"enabled": False}})
    body = {"model": "m", "prompt": "hi", "temperature": 0}
    with httpx.Client(base_url=r.url) as http:
        assert [_post(http, body).headers["x-pagellm-cache"] for _ in range(2)] == ["miss", "miss"]
    a.status = 200
    with httpx.Client(base_url=off.url) as http:
        assert all("x-pagellm-cache" not in _post(http, body).headers for _ in range(2))
    assert len(a.bodies) == 4


def test_memory_cache_is_bounded_and_expires() -> None:
    async def run() -> None:
        store = MemoryStore(max_entries=2)
        for k in "abc":
            await store.set(k, k.encode(), 60)
        assert await store.get("a") is None and await store.get("c") == b"c"  # the least recent went
        await store.set("d", b"d", 1e-9)
        assert await store.get("d") is None  # expired
    asyncio.run(run())
