"""`pagellm router` in front of two real `pagellm serve` backends of the embedded model, through the
openai SDK: routing by model, greedy output identical to a direct call (streamed and not), and
prompts truncated with the model's own tokenizer to exactly the engine's prompt-token count."""
from __future__ import annotations

import httpx
import openai
import pytest
from conftest import SHARED_SERVER_FLAGS, SHARED_SERVER_NAME
from server_utils import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def beta_server(smollm2_path: str):
    flags = list(SHARED_SERVER_FLAGS)
    flags[flags.index(SHARED_SERVER_NAME)] = "beta"
    remote = RemoteServer(smollm2_path, *flags)
    yield remote
    remote.stop()


def test_router_over_two_engines(smollm2_server, beta_server, smollm2_path, router) -> None:
    r = router({"models": [
        {"name": SHARED_SERVER_NAME, "backends": [smollm2_server.url]},
        {"name": "beta", "backends": [beta_server.url], "tokenizer": smollm2_path, "max_input_tokens": 64,
         "length_policy": "truncate_left"},
    ]})
    routed = openai.OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
    prompt = "The capital of France is"
    for name, server in ((SHARED_SERVER_NAME, smollm2_server), ("beta", beta_server)):
        direct = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        want = direct.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
        got = routed.completions.with_raw_response.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
        assert got.headers["x-pagellm-backend"] == server.url
        assert got.parse().model == name and got.parse().choices[0].text == want.choices[0].text
        messages = [{"role": "user", "content": "Say hello."}]
        want_chat = direct.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
        stream = routed.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0,
                                                stream=True, extra_headers={"x-pagellm-cache-bypass": "1"})
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want_chat.choices[0].message.content
    assert {m.id for m in routed.models.list().data} == {SHARED_SERVER_NAME, "beta"}

    long_prompt = " ".join(["Paris is a city in France."] * 30)
    resp = httpx.post(f"{r.url}/v1/completions", json={"model": "beta", "prompt": long_prompt, "max_tokens": 1,
                                                       "temperature": 0}, timeout=60)
    assert resp.status_code == 200
    assert resp.json()["usage"]["prompt_tokens"] == 64  # the engine counts what the router cut
    before = int(resp.headers["x-pagellm-truncated"].split("->")[0])
    full = httpx.post(f"{beta_server.url}/v1/completions", json={"model": "beta", "prompt": long_prompt,
                                                                 "max_tokens": 1}, timeout=60)
    assert full.json()["usage"]["prompt_tokens"] == before  # and counted the prompt as the engine does
