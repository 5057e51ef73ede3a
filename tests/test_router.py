"""`pagellm router` against fake OpenAI-compatible backends: routing by model, canary weights,
prefix affinity, failover, streaming pass-through, /v1/models, reload, metrics."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from router_utils import QUIET, RouterProcess, RouterUnderTest, wait_until
from server_utils import metric_samples

from pagellm.cli.main import main
from pagellm.router.balance import Backend, ModelRoute, prefix_hashes
from pagellm.router.config import parse_config
from pagellm.router.proxy import open_upstream, respond


def test_routes_by_model_and_404s_unknown(fakes, router) -> None:
    a, b = fakes("a"), fakes("b")
    r = router({"models": [{"name": "alpha", "backends": [{"url": a.url}]},
                           {"name": "beta", "backends": [{"url": b.url}]}]})
    with httpx.Client(base_url=r.url) as http:
        for model, fake in (("alpha", a), ("beta", b), ("alpha", a)):
            resp = http.post("/v1/completions", json={"model": model, "prompt": "hi"},
                             headers={"x-request-id": f"rid-{model}", "x-other": "not forwarded"})
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["text"].startswith(fake.name + ":")
            assert resp.headers["x-pagellm-backend"] == fake.url
        assert http.post("/v1/embeddings", json={"model": "beta", "input": "x"}).status_code == 200
        resp = http.post("/v1/chat/completions", json={"model": "gamma", "messages": []})
    assert resp.status_code == 404
    error = resp.json()["error"]
    assert error["param"] == "model" and "gamma" in error["message"] and error["code"] == 404
    assert len(a.bodies) == 2 and b.paths == ["/v1/completions", "/v1/embeddings"]
    assert a.bodies[0] == {"model": "alpha", "prompt": "hi"}  # forwarded unchanged
    assert a.headers[0]["x-request-id"] == "rid-alpha" and "x-other" not in a.headers[0]


def test_stream_passes_through_chunk_by_chunk(fakes, router) -> None:
    a = fakes("a", stream_events=4)
    r = router({"models": [{"name": "alpha", "backends": [a.url]}]})
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}],
                                                 stream=True))
    assert [c.choices[0].delta.content for c in chunks] == [f"a:1:{i} " for i in range(4)]
    with httpx.Client(base_url=r.url) as http:
        direct = http.post(f"{a.url}/v1/completions", json={"model": "alpha", "prompt": "x", "stream": True})
        routed = http.post("/v1/completions", json={"model": "alpha", "prompt": "x", "stream": True})
    assert routed.headers["content-type"].startswith("text/event-stream")
    # Byte for byte what the backend sent (its request counter aside).
    assert routed.content == direct.content.replace(b"cmpl-2", b"cmpl-3").replace(b"a:2:", b"a:3:")


def test_gzip_backend_relayed_decoded(fakes, router) -> None:
    a = fakes("a", stream_events=4, gzip=True)
    r = router({"models": [{"name": "alpha", "backends": [a.url]}]})
    stream = {"model": "alpha", "prompt": "x", "stream": True}
    with httpx.Client(base_url=r.url) as http:
        direct = http.post(f"{a.url}/v1/completions", json=stream)  # httpx decodes it
        routed = http.post("/v1/completions", json=stream)
        whole = http.post("/v1/completions", json={"model": "alpha", "prompt": "x"})
    assert direct.headers["content-encoding"] == "gzip"
    assert "content-encoding" not in routed.headers and "content-encoding" not in whole.headers
    assert routed.content == direct.content.replace(b"cmpl-1", b"cmpl-2").replace(b"a:1:", b"a:2:")
    assert whole.json()["choices"][0]["text"] == "a:3"


def test_no_cap_on_connections_to_a_backend(fakes, router) -> None:
    gate = threading.Event()
    a = fakes("a", gate=gate)  # holds each request until the gate opens (or 10 s pass)
    r = router({**QUIET, "models": [{"name": "alpha", "backends": [a.url]}]})
    n = 110  # over aiohttp's default cap of 100 connections

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=r.url, timeout=30, limits=httpx.Limits(max_connections=None)) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={"model": "alpha", "prompt": f"p{i}"})
                                          for i in range(n)))

    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(asyncio.run, send_all())
        try:
            wait_until(lambda: len(a.bodies) == n, 8)  # all held at the backend at once, none queued
        finally:
            gate.set()
        responses = sent.result(timeout=30)
    assert [resp.status_code for resp in responses] == [200] * n


def test_models_merged_over_backends(fakes, router) -> None:
    a, b = fakes("served-a"), fakes("b")
    r = router({"models": [{"name": "alpha", "backends": [a.url]}, {"name": "b", "backends": [b.url]}]})
    data = httpx.get(f"{r.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["alpha", "b"]
    assert all(m["max_model_len"] == 77 for m in data)  # the backend's own description, renamed
    assert data[0]["root"] == "served-a"


def _route(weights: list[float], versions: list[str | None] | None = None, max_imbalance: int = 8) -> ModelRoute:
    urls = [f"http://b{i}:1" for i in range(len(weights))]
    versions = versions or [None] * len(weights)
    config = parse_config({"models": [{"name": "m", "backends": [
        {"url": u, "weight": w, **({"version": v} if v else {})} for u, w, v in zip(urls, weights, versions)]}]})
    return ModelRoute(config.models[0], {u: Backend(u) for u in urls}, max_imbalance)


def test_canary_split_and_sticky_sessions() -> None:
    route = _route([90, 10])
    random.seed(0)  # the draw is random.random(): seeded, the count is the same every run
    picks = [route.choose([], None)[0].url for _ in range(1000)]
    assert abs(picks.count("http://b1:1") / 1000 - 0.10) <= 0.03
    sticky = {s: route.choose([], f"user-{s}")[0].url for s in range(200)}
    assert all(route.choose([], f"user-{s}")[0].url == url for s, url in sticky.items())  # pinned
    assert abs(list(sticky.values()).count("http://b1:1") / 200 - 0.10) <= 0.06  # and still split by weight


def test_equal_weights_balance_by_prefix_then_load() -> None:
    route = _route([1, 1, 1])
    system = "You are a careful assistant. " * 20
    first = route.choose(prefix_hashes("m", system + "question one"), None)[0]
    first.remember(prefix_hashes("m", system + "question one"))
    first.in_flight, first.outstanding_tokens = 3, 3000  # busier than the others, but within max_imbalance
    for q in ("question two", "question three"):
        assert route.choose(prefix_hashes("m", system + q), None)[0] is first
    # A prompt without a known prefix goes to the least outstanding tokens.
    others = [b for v in route.versions for b, _ in v.backends if b is not first]
    others[0].outstanding_tokens = 10
    assert route.choose(prefix_hashes("m", "unrelated " * 50), None)[0] is others[1]
    # Overloaded: the affinity yields.
    first.in_flight = 8
    assert route.choose(prefix_hashes("m", system + "question four"), None)[0] is not first


def test_versions_group_backends_for_the_split() -> None:
    route = _route([45, 45, 10], ["v1", "v1", "v2"])
    assert [(v.name, v.weight) for v in route.versions] == [("v1", 90.0), ("v2", 10.0)]


def test_failover_before_first_byte_and_ejection(fakes, router) -> None:
    bad, good = fakes("bad", status=503), fakes("good")
    r = router({"models": [{"name": "m", "backends": [bad.url, good.url]}], "eject_after_failures": 2})
    bad_backend = r.state.table.backends[bad.url]

    def text(i: int) -> str:
        return http.post("/v1/completions", json={"model": "m", "prompt": f"p{i}"}).json()["choices"][0]["text"]

    with httpx.Client(base_url=r.url) as http:
        # Loads are equal, so each request draws its first backend: go on until "bad" is taken out.
        texts = [text(i) for i in range(40) if not bad_backend.ejected]
        texts += [text(i) for i in range(5)]  # after which it gets nothing
    assert all(t.startswith("good:") for t in texts)
    assert bad_backend.ejected and len(bad.bodies) == 2  # taken out after its second failure
    samples = metric_samples(r.url)
    assert samples["pagellm:router_failovers_total"] == 2
    bad.status = 200
    r.call(r.state.check_health())  # the probe brings it back
    assert not bad_backend.ejected


def test_unreachable_backend_fails_over(fakes, router) -> None:
    good = fakes("good")
    r = router({"models": [{"name": "m", "backends": ["http://127.0.0.1:9", good.url]}]})
    with httpx.Client(base_url=r.url) as http:
        for i in range(4):
            assert http.post("/v1/completions", json={"model": "m", "prompt": str(i)}).status_code == 200
    assert len(good.bodies) == 4


def test_no_backend_answers_is_a_503_in_openai_shape(router) -> None:
    r = router({"models": [{"name": "m", "backends": ["http://127.0.0.1:9"]}]})
    resp = httpx.post(f"{r.url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert resp.status_code == 503
    assert "no backend of model 'm' answered" in resp.json()["error"]["message"]


def test_broken_stream_ends_with_an_error_event(fakes, router) -> None:
    a = fakes("a", stream_events=5, break_after=2)
    r = router({"models": [{"name": "m", "backends": [a.url]}]})
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    received = []
    with pytest.raises(openai.APIError, match="broke off the stream"):
        for chunk in client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                    stream=True):
            received.append(chunk.choices[0].delta.content)
    assert received == ["a:1:0 ", "a:1:1 "]
    assert r.state.table.backends[a.url].in_flight == 0  # its load is given back


def test_client_gone_before_the_stream_starts_gives_the_backend_back(fakes, router) -> None:
    """A client that leaves between the backend's answer and the relay's first chunk: the relay never
    starts, yet its backend request is closed and its load and limits settled."""
    a = fakes("a", hold=True)
    r = router({"models": [{"name": "m", "backends": [a.url]}]})
    done: list[tuple[int, bytes | None]] = []

    async def on_done(tokens: int, content: bytes | None) -> None:
        done.append((tokens, content))

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await asyncio.sleep(0)  # a checkpoint, as a real socket's write may be: the disconnect's cancel lands here

    async def scenario() -> None:
        body = {"model": "m", "prompt": "x", "max_tokens": 4, "stream": True}
        up = await open_upstream(r.state, r.state.table.routes["m"], "/v1/completions", body, {}, [], None, 10)
        response = await respond(r.state, up, "m", True, 10, {}, on_done)
        await response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)

    r.call(scenario())
    assert done == [(0, None)]
    assert r.state.table.backends[a.url].in_flight == 0
    wait_until(lambda: a.disconnects == 1, 10)  # the backend's request was closed, not left generating


def test_reload_by_admin_route_keeps_requests_in_flight(fakes, router) -> None:
    gate = threading.Event()
    a, b = fakes("a", gate=gate), fakes("b")
    config = {"admin_key": "root", "models": [{"name": "m", "backends": [a.url]}]}
    r = router(config)
    with httpx.Client(base_url=r.url, timeout=20) as http:
        pending = []
        worker = threading.Thread(target=lambda: pending.append(
            http.post("/v1/completions", json={"model": "m", "prompt": "slow"})))
        worker.start()
        r.write({**QUIET, **config, "models": [{"name": "m", "backends": [b.url]},
                                                {"name": "n", "backends": [b.url]}]})
        assert http.post("/admin/reload").status_code == 401
        assert http.post("/admin/reload", headers={"authorization": "Bearer wrong"}).status_code == 401
        resp = http.post("/admin/reload", headers={"authorization": "Bearer root"})
        assert resp.status_code == 200 and resp.json()["models"] == ["m", "n"]
        assert http.post("/v1/completions", json={"model": "n", "prompt": "x"}).json()["choices"][0]["text"] == "b:1"
        gate.set()
        worker.join()
        assert pending[0].status_code == 200 and pending[0].json()["choices"][0]["text"] == "a:1"
        r.write({"models": [{"name": "m", "backends": ["ftp://x"]}], "admin_key": "root"})
        bad = http.post("/admin/reload", headers={"authorization": "Bearer root"})
        assert bad.status_code == 400 and "models[0].backends[0].url" in bad.json()["error"]["message"]
        assert http.post("/v1/completions", json={"model": "n", "prompt": "x"}).status_code == 200  # kept


def test_metrics_count_requests_per_backend_and_model(fakes, router) -> None:
    a = fakes("a")
    r = router({"models": [{"name": "m", "backends": [a.url]}]})
    for _ in range(3):
        httpx.post(f"{r.url}/v1/completions", json={"model": "m", "prompt": "x"})
    text = httpx.get(f"{r.url}/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("pagellm:router_requests_total{"))
    assert f'backend="{a.url}"' in line and 'model="m"' in line and 'code="200"' in line
    assert line.endswith(" 3.0")


@pytest.mark.parametrize(("raw", "where"), [
    ({"models": [{"name": "m", "backends": [{"url": "ftp://h:1"}]}]}, "models[0].backends[0].url"),
    ({"models": [{"name": "m", "backends": ["http://h:1"]}, {"name": "m", "backends": ["http://h:2"]}]},
     "models[1].name"),
    ({"models": [{"name": "m", "backends": ["http://h:1"]}], "keys": [{"key": "k", "name": "n",
                                                                        "requests_per_minute": 0}]},
     "keys[0].requests_per_minute"),
    ({"models": [{"name": "m", "backends": [{"url": "http://h:1", "weight": 0}]}]}, "models[0].backends[0].weight"),
    ({"models": [{"name": "m", "backends": ["http://h:1"], "max_input_tokens": 10}]}, "models[0].tokenizer"),
    ({"models": [{"name": "m", "backends": ["http://h:1"], "length_policy": "cut"}]}, "models[0].length_policy"),
    ({"models": [{"name": "m", "backends": ["http://h:1"]}], "cache": {"url": "memcached://x"}}, "cache.url"),
    ({"models": [{"name": "m", "backends": ["http://h:1"], "weights": 3}]}, "models[0].weights"),
    ({"models": []}, "models"),
])
def test_bad_config_names_the_key(raw, where) -> None:
    with pytest.raises(ValueError) as info:
        parse_config(raw)
    assert str(info.value).startswith(where + ":"), str(info.value)


def test_cli_bad_config_exits_2_naming_the_key(tmp_path, capsys) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps({"models": [{"name": "m", "backends": [{"url": "http://h:1", "weight": -1}]}]}))
    assert main(["router", "--config", str(path)]) == 2
    assert "models[0].backends[0].weight" in capsys.readouterr().err
    assert main(["router", "--backend", "m=http://h:1", "--cache-url", "redis://127.0.0.1:9/0"]) == 2
    assert "cache.url" in capsys.readouterr().err


def test_shared_system_prompt_sticks_to_one_backend(fakes, router) -> None:
    backends = [fakes(f"b{i}") for i in range(3)]
    r = router({"models": [{"name": "m", "backends": [b.url for b in backends]}]})
    system = {"role": "system", "content": "You answer questions about the company handbook. " * 10}
    with httpx.Client(base_url=r.url) as http:
        used = {http.post("/v1/chat/completions", json={"model": "m", "messages": [
            system, {"role": "user", "content": f"question {i}"}]}).headers["x-pagellm-backend"] for i in range(12)}
        assert len(used) == 1
        # Requests without a shared prefix spread by load (each ends before the next: ties are drawn).
        spread = {http.post("/v1/completions", json={"model": "m", "prompt": f"{i} unrelated"}).headers[
            "x-pagellm-backend"] for i in range(30)}
    assert len(spread) > 1


@pytest.mark.slow  # a `pagellm router` process (its imports take seconds on 2 cores)
def test_sighup_reloads_the_config(fakes, tmp_path) -> None:
    a = fakes("a")
    path = tmp_path / "router.yaml"
    path.write_text(json.dumps({"models": [{"name": "m", "backends": [a.url]}]}))
    process = RouterProcess(str(path))
    try:
        assert _ids(process.url) == ["m"]
        path.write_text(json.dumps({"models": [{"name": name, "backends": [a.url]} for name in ("m", "n")]}))
        process.process.send_signal(signal.SIGHUP)
        wait_until(lambda: _ids(process.url) == ["m", "n"], 30)
        assert httpx.post(f"{process.url}/v1/completions", json={"model": "n", "prompt": "x"}).status_code == 200
    finally:
        log = process.log_tail()
        assert process.stop() == 0, log


def _ids(url: str) -> list[str] | None:
    try:
        return [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=2).json()["data"]]
    except httpx.HTTPError:
        return None


def test_every_backend_failing_returns_the_last_answer(fakes, router) -> None:
    a, b = fakes("a", status=503), fakes("b", status=503)
    r = router({"models": [{"name": "m", "backends": [a.url, b.url]}]})
    resp = httpx.post(f"{r.url}/v1/completions", json={"model": "m", "prompt": "x"})
    assert resp.status_code == 503 and resp.json()["error"]["message"] == "fake failure"
    assert len(a.bodies) + len(b.bodies) == 2  # the first try and one retry, no more
    assert all(x.in_flight == 0 for x in r.state.table.backends.values())


def test_sticky_header_pins_a_session_to_one_canary_version(fakes, router) -> None:
    stable, canary = fakes("stable"), fakes("canary")
    r = router({"sticky_header": "x-session-id",
                "models": [{"name": "m", "backends": [{"url": stable.url, "weight": 50},
                                                      {"url": canary.url, "weight": 49}]}]})
    with httpx.Client(base_url=r.url) as http:
        def backend(session: int, i: int) -> str:
            return http.post("/v1/completions", json={"model": "m", "prompt": f"turn {i}"},
                             headers={"x-session-id": f"s{session}"}).headers["x-pagellm-backend"]
        pinned = [{backend(s, i) for i in range(3)} for s in range(16)]
    assert all(len(p) == 1 for p in pinned)
    assert {stable.url, canary.url} == set().union(*pinned)  # sessions still split between the versions


def test_chat_page_served_without_the_dashboard_and_with_keys(fakes, router, tmp_path) -> None:
    """The router serves `pagellm serve`'s chat page (open even when keys are set: it holds no data);
    no dashboard nor /stats (no engine here), which the page reads as: hide its dashboard link."""
    a = fakes("a")
    r = router({"models": [{"name": "alpha", "backends": [{"url": a.url}]}], "keys": [{"key": "k1", "name": "t"}]})
    with httpx.Client(base_url=r.url) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="dashboard-link"' in page.text
        script = http.get("/ui/chat.js")
        assert script.headers["content-type"].startswith("text/javascript") and "dashboard-link" in script.text
        assert http.get("/dashboard").status_code == 404 and http.get("/stats").status_code == 404
        assert http.get("/v1/models").status_code == 401  # what the page fetches still needs the key
    off = RouterUnderTest({**QUIET, "models": [{"name": "alpha", "backends": [{"url": a.url}]}]},
                          str(tmp_path / "off.yaml"), web_ui=False)
    try:
        assert httpx.get(off.url + "/").status_code == 404 and httpx.get(off.url + "/ui/chat.js").status_code == 404
    finally:
        off.stop()
