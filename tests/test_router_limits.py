"""The router's API keys and per-key rate limits (requests, input and output tokens per minute, in
flight), in memory and in Redis (shared by two routers, in one process and in two, kept across a restart)."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from router_utils import RouterProcess

from pagellm.router.config import KeyConfig
from pagellm.router.limits import RateLimiter
from pagellm.router.resp import RedisClient, RedisError
from pagellm.router.store import MemoryStore, RedisStore

KEY = {"key": "secret-a", "name": "team-a"}


def _post(http: httpx.Client, key: str | None, prompt: str = "hi", model: str = "m") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return http.post("/v1/completions", json={"model": model, "prompt": prompt}, headers=headers)


def _assert_429(resp: httpx.Response, limit: str) -> None:
    assert resp.status_code == 429, resp.text
    error = resp.json()["error"]
    assert error["code"] == 429 and limit in error["message"] and "team-a" in error["message"]
    assert 1 <= int(resp.headers["retry-after"]) <= 60


def test_keys_authenticate(fakes, router) -> None:
    a, b = fakes("a"), fakes("b")
    r = router({"models": [{"name": "m", "backends": [a.url]},
                           {"name": "n", "backends": [{"url": b.url, "api_key": "backend-secret"}]}],
                "keys": [KEY]})
    with httpx.Client(base_url=r.url) as http:
        for key in (None, "wrong"):
            resp = _post(http, key)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "AuthenticationError"
        assert http.get("/v1/models").status_code == 401
        assert _post(http, "secret-a").status_code == 200
        assert _post(http, "secret-a", model="n").status_code == 200
    assert len(a.bodies) == 1
    assert "authorization" not in a.headers[0]  # the client's key is not forwarded
    assert b.headers[0]["authorization"] == "Bearer backend-secret"  # the backend's own is sent


def test_requests_per_minute(fakes, router) -> None:
    a = fakes("a")
    r = router({"models": [{"name": "m", "backends": [a.url]}], "keys": [{**KEY, "requests_per_minute": 3}]})
    with httpx.Client(base_url=r.url) as http:
        codes = [_post(http, "secret-a").status_code for _ in range(3)]
        assert codes == [200, 200, 200]
        _assert_429(_post(http, "secret-a"), "requests_per_minute")
    assert len(a.bodies) == 3
    assert r.state.metrics.throttled.labels("team-a", "requests_per_minute")._value.get() == 1


def test_output_tokens_per_minute_counts_usage(fakes, router) -> None:
    a = fakes("a", output_tokens=10)
    r = router({"models": [{"name": "m", "backends": [a.url]}], "keys": [{**KEY, "output_tokens_per_minute": 15}]})
    with httpx.Client(base_url=r.url) as http:
        assert [_post(http, "secret-a").status_code for _ in range(2)] == [200, 200]  # 0, then 10 < 15 used
        _assert_429(_post(http, "secret-a"), "output_tokens_per_minute")  # 20 used


def test_output_tokens_of_a_stream_count_its_usage(fakes, router) -> None:
    a = fakes("a", output_tokens=10)
    r = router({"models": [{"name": "m", "backends": [a.url]}], "keys": [{**KEY, "output_tokens_per_minute": 15}]})
    body = {"model": "m", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=r.url, headers={"authorization": "Bearer secret-a"}) as http:
        assert [http.post("/v1/completions", json=body).status_code for _ in range(2)] == [200, 200]
        _assert_429(http.post("/v1/completions", json=body), "output_tokens_per_minute")


def test_input_tokens_per_minute(fakes, router) -> None:
    a = fakes("a")
    r = router({"models": [{"name": "m", "backends": [a.url]}], "keys": [{**KEY, "input_tokens_per_minute": 100}]})
    with httpx.Client(base_url=r.url) as http:
        # Without a tokenizer a prompt counts len/4 + 1 tokens: 200 characters are 51.
        assert _post(http, "secret-a", "x" * 200).status_code == 200
        _assert_429(_post(http, "secret-a", "x" * 200), "input_tokens_per_minute")
        assert _post(http, "secret-a", "x" * 100).status_code == 200  # 51 + 26 <= 100: the refused one took nothing


def test_max_concurrent(fakes, router) -> None:
    gate = threading.Event()
    a = fakes("a", gate=gate)
    r = router({"models": [{"name": "m", "backends": [a.url]}], "keys": [{**KEY, "max_concurrent": 1}]})
    with httpx.Client(base_url=r.url, timeout=20) as http:
        first: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: first.append(_post(http, "secret-a")))
        worker.start()
        deadline = 200
        while not a.bodies and deadline:  # the first request has reached the backend
            deadline -= 1
            threading.Event().wait(0.05)
        assert a.bodies, "the first request never reached the backend"
        resp = _post(http, "secret-a")
        assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
        gate.set()
        worker.join()
        assert first[0].status_code == 200
        assert _post(http, "secret-a").status_code == 200  # its slot was given back


def _limiter_admits(store_factory, n: int) -> list[bool]:
    key = KeyConfig("k", "shared-key", requests_per_minute=n)

    async def run() -> list[bool]:
        limiters = [RateLimiter(store_factory()), RateLimiter(store_factory())]  # two routers
        results = [await limiters[i % 2].admit(key, 1) is None for i in range(n + 2)]
        for limiter in limiters:
            await limiter.store.close()
        return results
    return asyncio.run(run())


def test_memory_limits_are_per_process() -> None:
    assert _limiter_admits(MemoryStore, 4) == [True] * 6  # each router counts its own 3


def test_redis_limits_are_shared_by_routers_and_kept_across_restarts(redis_url) -> None:
    results = _limiter_admits(lambda: RedisStore(redis_url), 4)
    assert results == [True] * 4 + [False] * 2
    assert _limiter_admits(lambda: RedisStore(redis_url), 4) == [False] * 6  # a restart: the window's count stays


def test_redis_cache_shared_by_router_replicas(fakes, router, redis_url) -> None:
    a = fakes("a")
    config = {"models": [{"name": "m", "backends": [a.url]}], "cache": {"url": redis_url}}
    r1, r2 = router(config), router(config)
    body = {"model": "m", "prompt": "hi", "temperature": 0}
    first = httpx.post(f"{r1.url}/v1/completions", json=body)
    second = httpx.post(f"{r2.url}/v1/completions", json=body)
    assert (first.headers["x-pagellm-cache"], second.headers["x-pagellm-cache"]) == ("miss", "hit")
    assert second.content == first.content and len(a.bodies) == 1


def test_redis_failure_while_running_degrades_to_memory(caplog) -> None:
    async def run() -> None:
        store = RedisStore("redis://127.0.0.1:9/0")  # nothing listens: as if Redis went down
        with pytest.raises(ValueError, match="cache.url"):
            await store.check()
        assert await store.add("c", 2, 60) == 2 and await store.add("c", 3, 60) == 5
        await store.set("k", b"v", 60)
        assert await store.get("k") == b"v"
    asyncio.run(run())
    warnings = [r for r in caplog.records if "redis unavailable" in r.getMessage()]
    assert len(warnings) == 1  # once per outage


def test_resp_client_reports_unreachable_redis() -> None:
    with pytest.raises(RedisError, match="unreachable"):
        asyncio.run(RedisClient("redis://127.0.0.1:9/0").execute("PING"))


SHARED_RPM = 4


def _spread_then_restart(routers: list[RouterProcess], path: str) -> list[httpx.Response]:
    """SHARED_RPM requests alternating over the two routers, one more on each, then one on the
    second router restarted: every response."""
    responses = [_post_to(routers[i % 2].url, f"p{i}") for i in range(SHARED_RPM)]
    responses += [_post_to(r.url, "over") for r in routers]
    routers[1].stop()
    routers[1] = RouterProcess(path)
    return [*responses, _post_to(routers[1].url, "after restart")]


def _post_to(url: str, prompt: str) -> httpx.Response:
    with httpx.Client(base_url=url) as http:
        return _post(http, "secret-a", prompt)


@pytest.mark.slow
def test_limits_shared_by_two_router_processes(fakes, redis_url, tmp_path) -> None:
    a = fakes("a")
    path = str(tmp_path / "router.yaml")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"models": [{"name": "m", "backends": [a.url]}], "cache": {"url": redis_url},
                   "keys": [{**KEY, "requests_per_minute": SHARED_RPM}]}, f)
    routers = [RouterProcess(path), RouterProcess(path)]
    try:
        # The counters are per wall-clock minute: the run starts with at least half a minute left
        # in the current one (its requests and one router restart take a few seconds), so that
        # every request of the run falls in one window.
        left_s = 60 - time.time() % 60
        if left_s < 30:
            time.sleep(left_s + 0.1)  # waiting for the limiter's next window, not for another thread
        window, seen = time.time() // 60, len(a.bodies)
        responses = _spread_then_restart(routers, path)
        assert time.time() // 60 == window, "the run took more than half a minute"
    finally:
        codes = [r.stop() for r in routers]
    assert [r.status_code for r in responses[:SHARED_RPM]] == [200] * SHARED_RPM
    for resp in responses[SHARED_RPM:]:  # on either router, and on the restarted one
        _assert_429(resp, "requests_per_minute")
    assert len(a.bodies) - seen == SHARED_RPM
    assert codes == [0, 0]
