"""`pagellm router --prefill ... --decode ...` in front of real `pagellm serve` engines of the embedded
model: greedy text and logprobs equal a single server's (streamed and not), `pagellm bench serve`
runs through it unchanged, concurrent requests of which some are cut leave no KV blocks held on any
engine, and (last: it kills an engine) a decode engine killed mid-stream fails
its request while the other decode engine keeps serving.

The engines here have no KV connector, so each prefill engine refuses the transfer request (400)
and every request takes the fallback (decode prefills itself): the router's whole path over real
engines, with the fallback counted."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from conftest import SHARED_SERVER_FLAGS, SHARED_SERVER_NAME
from router_utils import wait_until
from server_utils import RemoteServer, is_idle, metric_samples

from pagellm.cli import main as cli_main

pytestmark = pytest.mark.slow

KILL_TIMEOUT_S = 30.0
"""Bound on the stream's end after its engine dies (it should be immediate: the socket closes)."""


@pytest.fixture(scope="module")
def prefill_server(smollm2_path: str):
    remote = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS)
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def decode_server(smollm2_path: str):
    """The decode engine the last test kills; the shared server is the pool's other one."""
    remote = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS)
    yield remote
    remote.stop()


@pytest.fixture
def pd_router(router, prefill_server, decode_server, smollm2_server):
    return router({"prefill": [prefill_server.url], "decode": [decode_server.url, smollm2_server.url]})


def _outcomes(url: str) -> dict[str, float]:
    samples = metric_samples(url)
    return {k: v for k, v in samples.items() if k.startswith("pagellm:router_pd_")}


def test_greedy_output_equals_a_single_server(pd_router, smollm2_server) -> None:
    routed = openai.OpenAI(base_url=f"{pd_router.url}/v1", api_key="unused", max_retries=0)
    single = openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="unused", max_retries=0)
    prompts = ["The capital of France is", "Once upon a time, " + "there was a small village by the sea. " * 60]
    for prompt in prompts:
        kwargs = dict(model=SHARED_SERVER_NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=1)
        want = single.completions.create(**kwargs).choices[0]
        got = routed.completions.create(**kwargs, extra_headers={"x-pagellm-cache-bypass": "1"}).choices[0]
        assert got.text == want.text
        assert got.logprobs.tokens == want.logprobs.tokens
        assert got.logprobs.token_logprobs == pytest.approx(want.logprobs.token_logprobs, abs=1e-4)
        stream = routed.completions.create(**kwargs, stream=True, extra_headers={"x-pagellm-cache-bypass": "1"})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    messages = [{"role": "user", "content": "Name three colours."}]
    want_chat = single.chat.completions.create(model=SHARED_SERVER_NAME, messages=messages, max_tokens=10,
                                               temperature=0).choices[0].message.content
    stream = routed.chat.completions.create(model=SHARED_SERVER_NAME, messages=messages, max_tokens=10,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage.completion_tokens == 10  # the decode engine's own usage
    assert [m.id for m in routed.models.list().data] == [SHARED_SERVER_NAME]
    # No engine here has a connector: the prefill engine refuses kv_transfer_params, decode prefills.
    outcomes = _outcomes(pd_router.url)
    assert outcomes["pagellm:router_pd_requests_total"] == 2 * len(prompts) + 1
    assert outcomes["pagellm:router_pd_fallbacks_total{prefill_error}"] == 2 * len(prompts) + 1


def test_bench_serve_through_the_router(pd_router, tmp_path, capsys) -> None:
    path = tmp_path / "serve.json"
    assert cli_main(["bench", "serve", "--base-url", pd_router.url + "/v1", "--num-prompts", "4", "--input-len",
                     "16", "--output-len", "4", "--disable-tqdm", "--output-json", str(path)]) == 0
    capsys.readouterr()
    result = json.loads(path.read_text())
    assert result["model_id"] == SHARED_SERVER_NAME and result["usage_from_server"]
    assert result["completed"] == 4 and result["failed"] == 0 and result["output_lens"] == [4] * 4
    assert _outcomes(pd_router.url)["pagellm:router_pd_requests_total"] == 4


async def _churn(url: str, num_kept: int, num_cut: int) -> list[httpx.Response]:
    """`num_kept` requests answered in full and `num_cut` whose client goes mid-flight (half while
    streaming, half before a non-streamed answer), all at once; the kept ones' responses."""
    long = {"model": SHARED_SERVER_NAME, "max_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def cut(http: httpx.AsyncClient, i: int) -> None:
        if i % 2:
            async with http.stream("POST", "/v1/completions", json={**long, "prompt": f"Story {i}:",
                                                                    "stream": True}) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        return  # closing the stream mid-flight
        with pytest.raises(asyncio.TimeoutError):  # 400 tokens of 30 requests take far longer
            await asyncio.wait_for(http.post("/v1/completions", json={**long, "prompt": f"Story {i}:"}), 1.0)

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        kept = [http.post("/v1/completions", json={"model": SHARED_SERVER_NAME, "prompt": f"Fact {i}:",
                                                   "max_tokens": 8, "ignore_eos": True, "temperature": 0})
                for i in range(num_kept)]
        results = await asyncio.gather(*kept, *(cut(http, i) for i in range(num_cut)))
    return results[:num_kept]


def test_cut_requests_leave_no_blocks_held(pd_router, prefill_server, decode_server, smollm2_server) -> None:
    engines = (prefill_server, decode_server, smollm2_server)
    aborted_before = sum(metric_samples(e.url).get("pagellm:request_success_total{abort}", 0) for e in engines)
    num_kept, num_cut = 20, 10
    responses = asyncio.run(_churn(pd_router.url, num_kept, num_cut))
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8 for r in responses)
    wait_until(lambda: all(is_idle(metric_samples(e.url)) for e in engines), 60)
    aborted = sum(metric_samples(e.url).get("pagellm:request_success_total{abort}", 0) for e in engines)
    assert aborted - aborted_before == num_cut  # each cut request was aborted on its engine
    assert all(b.in_flight == 0 and b.outstanding_tokens == 0 for b in pd_router.state.table.backends.values())


def test_decode_engine_killed_mid_stream(pd_router, decode_server, smollm2_server) -> None:
    """Last in the module: it kills the decode engine. Its stream ends with an error event at once,
    and later requests go to the other decode engine."""
    pd_router.state.table.backends[smollm2_server.url].outstanding_tokens = 10**9  # the victim takes the stream
    body = {"model": SHARED_SERVER_NAME, "prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events: list[str] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{pd_router.url}/v1/completions", json=body, timeout=KILL_TIMEOUT_S) as resp:
        assert resp.status_code == 200 and resp.headers["x-pagellm-backend"] == decode_server.url
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 1:  # the stream has started: kill its engine, server and engine core
                engine_pid = decode_server.engine_pid()
                killed = time.monotonic()
                decode_server.process.send_signal(signal.SIGKILL)
                os.kill(engine_pid, signal.SIGKILL)
    assert time.monotonic() - killed < 5 and time.monotonic() - started < KILL_TIMEOUT_S
    assert "[DONE]" not in events and len(events) < body["max_tokens"]
    assert f"backend {decode_server.url} broke off the stream" in json.loads(events[-1])["error"]["message"]
    decode_server.process.wait(timeout=KILL_TIMEOUT_S)
    pd_router.state.table.backends[smollm2_server.url].outstanding_tokens = 0
    for i in range(3):
        resp = httpx.post(f"{pd_router.url}/v1/completions", timeout=60, json={
            "model": SHARED_SERVER_NAME, "prompt": f"Hello {i}", "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200 and resp.headers["x-pagellm-backend"] == smollm2_server.url
