"""`pagellm router` in front of three real `pagellm serve` backends of the embedded model (one also
serving a LoRA adapter), through the openai SDK, LangChain and litellm: routing by model and to the
adapter, greedy output identical to a direct call (streamed and not), prefix affinity seen in the
engines' own prefix-cache counters, prompts truncated with the model's tokenizer to exactly the
engine's prompt-token count, and (last: it kills an engine) a backend killed mid-stream."""
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
from lora_utils import ALL_MODULES, save_adapter
from server_utils import RemoteServer, metric_samples

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def beta_server(smollm2_path: str):
    """A second engine, serving the model as "beta" and under the shared server's name too (so both
    engines can form one pool)."""
    flags = list(SHARED_SERVER_FLAGS)
    flags[flags.index(SHARED_SERVER_NAME)] = "beta"
    remote = RemoteServer(smollm2_path, *flags, SHARED_SERVER_NAME)
    yield remote
    remote.stop()


ADAPTER = "smollm2-adapter"


@pytest.fixture(scope="module")
def lora_server(smollm2_path, hf_smollm2_model, tmp_path_factory):
    """A third engine: the base model under the shared server's name (a pool with beta) and a random
    PEFT adapter of it as ADAPTER."""
    folder = tmp_path_factory.mktemp("adapter")
    save_adapter(hf_smollm2_model, folder, r=8, alpha=16, targets=ALL_MODULES, seed=0)
    remote = RemoteServer(smollm2_path, *SHARED_SERVER_FLAGS, "--enable-lora", "--max-lora-rank", "8",
                          "--lora-modules", f"{ADAPTER}={folder}")
    yield remote
    remote.stop()  # after the last test killed it or not: the exit status says nothing here


def test_router_over_two_engines(smollm2_server, beta_server, smollm2_path, router) -> None:
    r = router({"models": [
        {"name": SHARED_SERVER_NAME, "backends": [smollm2_server.url, beta_server.url]},
        {"name": "beta", "backends": [beta_server.url], "tokenizer": smollm2_path, "max_input_tokens": 64,
         "length_policy": "truncate_left"},
    ]})
    routed = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=f"{beta_server.url}/v1", api_key="unused", max_retries=0)
    prompt = "The capital of France is"
    messages = [{"role": "user", "content": "Say hello."}]
    want = direct.completions.create(model="beta", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    want_chat = direct.chat.completions.create(model="beta", messages=messages, max_tokens=8,
                                               temperature=0).choices[0].message.content
    for name in (SHARED_SERVER_NAME, "beta"):
        got = routed.completions.with_raw_response.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
        if name == "beta":
            assert got.headers["x-pagellm-backend"] == beta_server.url  # only beta's engine serves "beta"
        assert got.parse().model == name and got.parse().choices[0].text == want
        stream = routed.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                stream=True, extra_headers={"x-pagellm-cache-bypass": "1"})
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want_chat
    assert {m.id for m in routed.models.list().data} == {SHARED_SERVER_NAME, "beta"}
    # Imported here: langchain takes seconds to import, which collecting the quick tier need not pay.
    from langchain_openai import ChatOpenAI  # noqa: PLC0415

    chat = ChatOpenAI(model="beta", base_url=f"{r.url}/v1", api_key="unused", max_tokens=8, temperature=0,
                      default_headers={"x-pagellm-cache-bypass": "1"})
    assert chat.invoke("Say hello.").content == want_chat  # LangChain unchanged through the router
    assert "".join(c.content for c in chat.stream("Say hello.")) == want_chat
    import litellm  # noqa: PLC0415 (seconds to import, as langchain)

    kwargs = dict(model="openai/beta", api_base=f"{r.url}/v1", api_key="unused", messages=messages, max_tokens=8,
                  temperature=0, extra_headers={"x-pagellm-cache-bypass": "1"})
    assert litellm.completion(**kwargs).choices[0].message.content == want_chat  # litellm unchanged too
    assert "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kwargs, stream=True)) == want_chat

    # One long system prompt, several questions: they all go to one engine, which reuses its KV.
    system = {"role": "system", "content": "You answer questions about the Paris city guide. " * 12}
    servers = {s.url: s for s in (smollm2_server, beta_server)}
    hits_before = {u: metric_samples(u).get("pagellm:prefix_cache_hits_total", 0.0) for u in servers}
    used = set()
    for i in range(6):  # by chance alone, six requests would land on one of two engines 1 time in 32
        resp = routed.chat.completions.with_raw_response.create(
            model=SHARED_SERVER_NAME, messages=[system, {"role": "user", "content": f"Question {i}?"}], max_tokens=1)
        used.add(resp.headers["x-pagellm-backend"])
    assert len(used) == 1
    (url,) = used
    hits = metric_samples(url)["pagellm:prefix_cache_hits_total"] - hits_before[url]
    assert hits >= 5 * 100  # the five later requests each reuse the system prompt's blocks (> 100 tokens)

    long_prompt = " ".join(["Paris is a city in France."] * 30)
    resp = httpx.post(f"{r.url}/v1/completions", json={"model": "beta", "prompt": long_prompt, "max_tokens": 1,
                                                       "temperature": 0}, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == 64  # the engine counts what the router cut
    before = int(resp.headers["x-pagellm-truncated"].split("->")[0])
    full = httpx.post(f"{beta_server.url}/v1/completions", json={"model": "beta", "prompt": long_prompt,
                                                                 "max_tokens": 1}, timeout=60)
    assert full.json()["usage"]["prompt_tokens"] == before  # and counted the prompt as the engine does


def test_router_to_a_lora_adapter(lora_server, router) -> None:
    r = router({"models": [{"name": ADAPTER, "backends": [lora_server.url]}]})
    routed = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)
    prompt = "The capital of France is"
    base = direct.completions.create(model=SHARED_SERVER_NAME, prompt=prompt, max_tokens=8, temperature=0)
    want = direct.completions.create(model=ADAPTER, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert want != base.choices[0].text  # the adapter changes the output: routing to it is visible
    got = routed.completions.create(model=ADAPTER, prompt=prompt, max_tokens=8, temperature=0)
    assert got.model == ADAPTER and got.choices[0].text == want
    stream = routed.completions.create(model=ADAPTER, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       extra_headers={"x-pagellm-cache-bypass": "1"})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want


CANARY_REQUESTS = 1000


def test_canary_split_over_real_engines(smollm2_server, beta_server, router) -> None:
    """A 90/10 canary over two engines: of 1,000 requests, the share each engine served (by the router's
    header and by the engine's own request counter) is within 3 points of its weight."""
    stable, canary = smollm2_server, beta_server
    r = router({"models": [{"name": SHARED_SERVER_NAME, "backends": [{"url": stable.url, "weight": 90},
                                                                     {"url": canary.url, "weight": 10}]}]})
    counter = "pagellm:request_success_total"
    before = {s.url: _successes(s.url, counter) for s in (stable, canary)}

    async def send_all() -> list[str]:
        limit = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(i: int) -> str:
                async with limit:
                    resp = await client.post(f"{r.url}/v1/completions", headers={"x-pagellm-cache-bypass": "1"},
                                             json={"model": SHARED_SERVER_NAME, "prompt": f"Count {i}:",
                                                   "max_tokens": 1})
                assert resp.status_code == 200, resp.text
                return resp.headers["x-pagellm-backend"]
            return await asyncio.gather(*(one(i) for i in range(CANARY_REQUESTS)))

    served = asyncio.run(send_all())
    share = served.count(canary.url) / CANARY_REQUESTS
    assert served.count(stable.url) + served.count(canary.url) == CANARY_REQUESTS
    assert abs(share - 0.10) <= 0.03, share
    reached = {u: _successes(u, counter) - before[u] for u in before}
    assert reached == {stable.url: served.count(stable.url), canary.url: served.count(canary.url)}


def _successes(url: str, name: str) -> float:
    """The engine's finished requests, every finish reason together."""
    return sum(v for k, v in metric_samples(url).items() if k.startswith(name))


KILL_TIMEOUT_S = 30.0
"""Bound on the stream's end after its engine dies (it should be immediate: the socket closes)."""


def test_backend_killed_mid_stream(beta_server, lora_server, router) -> None:
    """Last in the module: it kills one of its engines. A stream open on that engine ends with an
    error event, and later requests of the model go to the other engine."""
    servers = {s.url: s for s in (beta_server, lora_server)}
    r = router({"models": [{"name": SHARED_SERVER_NAME, "backends": list(servers)}]})
    body = {"model": SHARED_SERVER_NAME, "prompt": "Once upon a time", "max_tokens": 600, "ignore_eos": True,
            "temperature": 0, "stream": True}
    events: list[str] = []
    started = time.monotonic()
    with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=KILL_TIMEOUT_S) as resp:
        assert resp.status_code == 200
        victim = servers.pop(resp.headers["x-pagellm-backend"])
        (survivor,) = servers.values()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 1:  # the stream has started: kill its engine, server and engine core
                engine_pid = victim.engine_pid()
                victim.process.send_signal(signal.SIGKILL)
                os.kill(engine_pid, signal.SIGKILL)
    assert time.monotonic() - started < KILL_TIMEOUT_S
    assert "[DONE]" not in events
    assert "error" in json.loads(events[-1])  # OpenAI clients raise on it
    assert len(events) < body["max_tokens"]  # it ended early, not by finishing
    victim.process.wait(timeout=KILL_TIMEOUT_S)
    for i in range(3):  # requests started after the kill: the other engine answers each
        resp = httpx.post(f"{r.url}/v1/completions", timeout=60, json={
            "model": SHARED_SERVER_NAME, "prompt": f"Hello {i}", "max_tokens": 2, "temperature": 0})
        assert resp.status_code == 200 and resp.headers["x-pagellm-backend"] == survivor.url
