"""`pagellm router` in front of two real `pagellm serve` backends of the embedded model, through the
openai SDK: routing by model, greedy output identical to a direct call (streamed and not), prefix
affinity seen in the engines' own prefix-cache counters, and prompts truncated with the model's
tokenizer to exactly the engine's prompt-token count."""
from __future__ import annotations

import httpx
import openai
import pytest
from conftest import SHARED_SERVER_FLAGS, SHARED_SERVER_NAME
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
