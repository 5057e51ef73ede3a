"""`pagellm router --prefill ... --decode ...` against fake backends: what each pool receives, the
decode engine's answer passed through, fallbacks when the prefill gives no KV, pools balanced
apart, a dying decode engine, client disconnects reaching the engines, config errors."""
from __future__ import annotations

import json
import random
import socket
import time
from urllib.parse import urlparse

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from router_utils import wait_until

from pagellm.cli.main import main
from pagellm.router.config import parse_config

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "engine-p",
      "remote_block_ids": [3, 4, 5], "remote_host": "10.0.0.1", "remote_port": 5600,
      "remote_request_id": "req-1", "tp_size": 1}
PREFILL_REQUEST = {"do_remote_decode": True, "do_remote_prefill": False}


def _pd(router, prefill, decode, **config):
    return router({"prefill": [p.url for p in prefill], "decode": [d.url for d in decode], **config})


def _samples(url: str, name: str) -> dict[str, float]:
    """label values joined by ',' -> value, for the samples of metric `name` on the router's /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return {",".join(s.labels.values()): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def test_prefill_then_decode_with_the_returned_params(fakes, router) -> None:
    p, d = fakes("p", kv_params=KV), fakes("d")
    r = _pd(router, [p], [d])
    body = {"model": "m", "prompt": "hello", "max_tokens": 20, "min_tokens": 3, "temperature": 0.5,
            "kv_transfer_params": {"remote_host": "evil"}}  # a client's own params reach no engine
    resp = httpx.post(f"{r.url}/v1/completions", json=body)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == "d:1" and resp.headers["x-pagellm-backend"] == d.url
    assert p.bodies == [{"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0.5, "stream": False,
                         "kv_transfer_params": PREFILL_REQUEST}]
    assert d.bodies == [{**body, "kv_transfer_params": KV}]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9,
            "stream": True, "stream_options": {"include_usage": True}}
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.chat.completions.create(**chat))
    # The decode engine's stream passes through, its usage included.
    assert [c.choices[0].delta.content for c in chunks if c.choices] == [f"d:2:{i} " for i in range(3)]
    assert chunks[-1].usage.completion_tokens == d.output_tokens
    assert p.bodies[1] == {"model": "m", "messages": chat["messages"], "max_completion_tokens": 1, "max_tokens": 1,
                           "stream": False, "kv_transfer_params": PREFILL_REQUEST}
    assert d.bodies[1] == {**chat, "kv_transfer_params": KV}
    assert _samples(r.url, "pagellm:router_pd_requests_total") == {"transferred": 2}
    assert _samples(r.url, "pagellm:router_pd_prefill_seconds_count") == {p.url: 2}
    assert _samples(r.url, "pagellm:router_pd_fallbacks_total") == {}


def test_several_sequences_skip_the_prefill(fakes, router) -> None:
    p, d = fakes("p", kv_params=KV), fakes("d")
    r = _pd(router, [p], [d])
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, "n": 3}
    assert httpx.post(f"{r.url}/v1/completions", json=body).status_code == 200
    assert p.bodies == [] and d.bodies == [body]
    assert _samples(r.url, "pagellm:router_pd_fallbacks_total") == {"n_above_1": 1}


@pytest.mark.parametrize(("knobs", "reason"), [({"kv_params": None}, "no_kv_transfer_params"),
                                               ({"status": 400}, "prefill_error"),
                                               ({"break_after": 0}, "prefill_error"),
                                               (None, "prefill_unavailable")])
def test_fallback_sends_the_plain_request_to_decode(fakes, router, knobs, reason) -> None:
    d = fakes("d")
    prefill = [fakes("p", **knobs).url] if knobs is not None else ["http://127.0.0.1:9"]  # nothing listens
    r = router({"prefill": prefill, "decode": [d.url]})
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    for i in range(2):
        resp = httpx.post(f"{r.url}/v1/completions", json=body)
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == f"d:{i + 1}"
    assert d.bodies == [body, body]  # decode prefills itself
    assert _samples(r.url, "pagellm:router_pd_fallbacks_total") == {reason: 2}
    assert _samples(r.url, "pagellm:router_pd_requests_total") == {"fallback": 2}
    assert all(b.in_flight == 0 for b in r.state.table.backends.values())


def test_pools_are_balanced_apart(fakes, router) -> None:
    prefill = [fakes(f"p{i}", kv_params={**KV, "remote_engine_id": f"p{i}"}) for i in range(2)]
    decode = [fakes(f"d{i}") for i in range(2)]
    r = _pd(router, prefill, decode)
    random.seed(0)  # ties in load are drawn: seeded, every run draws the same
    with httpx.Client(base_url=r.url) as http:
        for i in range(16):
            assert http.post("/v1/completions", json={"model": "m", "prompt": f"{i}", "max_tokens": 3}).status_code \
                == 200
    assert all(len(f.bodies) > 0 for f in prefill + decode)
    assert sum(len(f.bodies) for f in prefill) == sum(len(f.bodies) for f in decode) == 16
    assert all(b["max_tokens"] == 1 for f in prefill for b in f.bodies)
    assert all(b["max_tokens"] == 3 for f in decode for b in f.bodies)
    # A decode engine is drawn from its own pool, whichever prefill engine computed the prompt.
    pairs = {(b["kv_transfer_params"]["remote_engine_id"], f.name) for f in decode for b in f.bodies}
    assert len(pairs) > 2


def test_prefill_fails_over_within_its_pool(fakes, router) -> None:
    p, d = fakes("p", kv_params=KV), fakes("d")
    r = router({"prefill": ["http://127.0.0.1:9", p.url], "decode": [d.url]})  # nothing listens on port 9
    for i in range(4):
        assert httpx.post(f"{r.url}/v1/completions", json={"model": "m", "prompt": f"{i}"}).status_code == 200
    assert len(p.bodies) == 4 and all(b["kv_transfer_params"] == KV for b in d.bodies)
    assert _samples(r.url, "pagellm:router_pd_requests_total") == {"transferred": 4}


def test_busy_decode_engine_gets_no_more_while_prefill_balances_alone(fakes, router) -> None:
    prefill = [fakes(f"p{i}", kv_params=KV) for i in range(2)]
    decode = [fakes(f"d{i}") for i in range(2)]
    r = _pd(router, prefill, decode)
    busy = r.state.table.backends[decode[0].url]
    busy.outstanding_tokens = 10**6  # as if it decoded long requests
    with httpx.Client(base_url=r.url) as http:
        for i in range(6):
            http.post("/v1/completions", json={"model": "m", "prompt": f"{i}", "max_tokens": 3})
    assert decode[0].bodies == [] and len(decode[1].bodies) == 6
    assert sum(len(p.bodies) for p in prefill) == 6


def test_models_embeddings_and_health_use_the_decode_pool(fakes, router) -> None:
    p, d = fakes("p-model", kv_params=KV), fakes("d-model")
    r = _pd(router, [p], [d])
    assert [m["id"] for m in httpx.get(f"{r.url}/v1/models").json()["data"]] == ["d-model"]
    assert httpx.post(f"{r.url}/v1/embeddings", json={"model": "m", "input": "x"}).status_code == 200
    assert d.paths == ["/v1/embeddings"] and p.paths == []
    health = httpx.get(f"{r.url}/health")
    assert health.status_code == 200 and health.json() == {"pools": {"prefill": True, "decode": True}}
    p.healthy = False
    for _ in range(r.state.table.config.eject_after_failures):
        r.call(r.state.check_health())
    health = httpx.get(f"{r.url}/health")  # decode prefills alone: still serving
    assert health.status_code == 200 and health.json()["pools"] == {"prefill": False, "decode": True}
    d.healthy = False
    for _ in range(r.state.table.config.eject_after_failures):
        r.call(r.state.check_health())
    assert httpx.get(f"{r.url}/health").status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_dying_decode_engine_fails_its_requests_and_the_others_serve(fakes, router, stream) -> None:
    p = fakes("p", kv_params=KV)
    dying, other = fakes("dying", break_after=1 if stream else 0), fakes("other")
    r = _pd(router, [p], [dying, other], eject_after_failures=1)
    r.state.table.backends[other.url].outstanding_tokens = 10**6  # the dying one takes the first request
    client = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    started = time.monotonic()
    if stream:
        with pytest.raises(openai.APIError, match=f"backend {dying.url} broke off the stream"):
            for _ in client.completions.create(model="m", prompt="x", max_tokens=5, stream=True):
                pass
    else:
        with pytest.raises(openai.InternalServerError, match=f"backend {dying.url} broke off its response") as e:
            client.completions.create(model="m", prompt="x", max_tokens=5)
        assert e.value.status_code == 502
    assert time.monotonic() - started < 5
    assert len(dying.bodies) == 1
    dying.stop()  # the process is gone: its port refuses
    r.state.table.backends[other.url].outstanding_tokens = 0
    texts = [client.completions.create(model="m", prompt=f"{i}", max_tokens=5).choices[0].text for i in range(4)]
    assert texts == [f"other:{i + 1}" for i in range(4)]
    assert all(b["kv_transfer_params"] == KV for b in other.bodies)
    assert r.state.table.backends[dying.url].ejected


def _post_then_drop(url: str, body: dict, until) -> bytes:
    """POST `body` on a raw connection, wait until `until()` holds, close the connection; what was read."""
    parsed = urlparse(url)
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parsed.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    received = b""
    with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as conn:
        conn.sendall(head + data)
        if body.get("stream"):
            while b"data: " not in received:  # the stream reached the client
                received += conn.recv(4096)
        wait_until(until, 10)
    return received


@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_client_gone_before_the_answer_aborts_the_engine_request(fakes, router, phase) -> None:
    p, d = fakes("p", hold=phase == "prefill", kv_params=KV), fakes("d", hold=phase == "decode")
    held = p if phase == "prefill" else d
    r = _pd(router, [p], [d])
    _post_then_drop(r.url, {"model": "m", "prompt": "x", "max_tokens": 4}, lambda: len(held.bodies) == 1)
    wait_until(lambda: held.disconnects == 1, 10)  # the router closed its request to the engine
    wait_until(lambda: all(b.in_flight == 0 for b in r.state.table.backends.values()), 10)
    assert len(d.bodies) == (phase == "decode")


def test_client_gone_during_a_decode_stream_aborts_it(fakes, router) -> None:
    p, d = fakes("p", kv_params=KV), fakes("d", hold=True)
    r = _pd(router, [p], [d])
    received = _post_then_drop(r.url, {"model": "m", "prompt": "x", "max_tokens": 4, "stream": True},
                               lambda: len(d.bodies) == 1)
    assert b"d:1:0" in received
    wait_until(lambda: d.disconnects == 1, 10)
    wait_until(lambda: all(b.in_flight == 0 for b in r.state.table.backends.values()), 10)


@pytest.mark.parametrize(("raw", "where"), [
    ({"prefill": ["http://h:1"]}, "decode"),
    ({"decode": ["http://h:1"]}, "prefill"),
    ({"prefill": ["http://h:1"], "decode": ["http://h:2", "http://h:1"]}, "decode[1].url"),
    ({"prefill": ["http://h:1"], "decode": ["http://h:2"], "models": [{"name": "m", "backends": ["http://h:3"]}]},
     "models"),
    ({"prefill": ["http://h:1"], "decode": ["http://h:2"], "sticky_header": "x-session"}, "sticky_header"),
    ({"prefill": [{"url": "http://h:1", "weight": 9}], "decode": ["http://h:2"]}, "prefill[0].weight"),
    ({"prefill": ["ftp://h:1"], "decode": ["http://h:2"]}, "prefill[0].url"),
    ({"prefill": "http://h:1", "decode": ["http://h:2"]}, "prefill"),
])
def test_bad_pd_config_names_the_key(raw, where) -> None:
    with pytest.raises(ValueError) as info:
        parse_config(raw)
    assert str(info.value).startswith(where + ":"), str(info.value)


def test_cli_pd_flags(capsys) -> None:
    assert main(["router", "--prefill", "http://h:1"]) == 2
    assert "--decode" in capsys.readouterr().err
    assert main(["router", "--prefill", "http://h:1", "--decode", "http://h:2", "--backend", "m=http://h:3"]) == 2
    assert "--backend" in capsys.readouterr().err
    assert main(["router", "--prefill", "http://h:1", "--decode", "http://h:1"]) == 2
    assert "decode[0].url" in capsys.readouterr().err
