"""`cache_salt` (vLLM's): a request's prefix-cache blocks are shared only with requests that send the
same salt, offline (`LLM.generate` prompt dicts, `LLM.chat`) and over HTTP (completions and chat)."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest
from conftest import SHARED_SERVER_NAME as MODEL_NAME
from engine_utils import TINY_LLAMA, assert_no_leak
from server_utils import metric_samples

from pagellm import LLM, SamplingParams

PROMPT_LEN = 80
"""Five blocks of 16 tokens: a repeat of the prompt can take the first four from the cache (the last
prompt token is always computed)."""
CACHEABLE = (PROMPT_LEN - 1) // 16 * 16


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory) -> LLM:
    folder = tmp_path_factory.mktemp("tiny-llama")
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA))
    return LLM(str(folder), load_format="dummy", device="cpu", dtype="float32", max_model_len=256,
               kv_cache_memory_bytes=8 << 20)


def prefix_hits(llm: LLM, prompt: dict, **sampling) -> int:
    """Prompt tokens the request took from the prefix cache."""
    before = llm.llm_engine.get_stats().prefix_cache_hits
    llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, **sampling), use_tqdm=False)
    return llm.llm_engine.get_stats().prefix_cache_hits - before


def salted(token_ids: list[int], salt: str | None) -> dict:
    return {"prompt_token_ids": token_ids, **({"cache_salt": salt} if salt is not None else {})}


def test_the_same_prompt_shares_blocks_only_with_the_same_salt(tiny_llm):
    ids = list(range(10, 10 + PROMPT_LEN))
    for salt in ("a", "b", None):
        assert prefix_hits(tiny_llm, salted(ids, salt)) == 0, f"first time with salt {salt!r}"
    for salt in ("a", "b", None):
        assert prefix_hits(tiny_llm, salted(ids, salt)) == CACHEABLE, f"again with salt {salt!r}"
    assert_no_leak(tiny_llm.llm_engine)


def test_n_children_keep_the_salt(tiny_llm):
    ids = list(range(100, 100 + PROMPT_LEN))
    engine = tiny_llm.llm_engine
    engine.add_request("parent", salted(ids, "c"), SamplingParams(n=2, seed=1, max_tokens=2))
    children = [r.record for r in engine.engine_core.scheduler.requests.values()]
    assert sorted(c.request_id for c in children) == ["0_parent", "1_parent"]
    assert all(c.cache_salt == "c" for c in children)
    while engine.has_unfinished_requests():
        engine.step()
    # The children's blocks are found under their salt only.
    assert prefix_hits(tiny_llm, salted(ids, None)) == 0
    assert prefix_hits(tiny_llm, salted(ids, "d")) == 0
    assert prefix_hits(tiny_llm, salted(ids, "c")) == CACHEABLE
    assert_no_leak(engine)


@pytest.mark.parametrize("salt", ["", 5, ["a"]])
def test_an_invalid_salt_is_refused_naming_it(tiny_llm, salt):
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        tiny_llm.generate(salted([1, 2, 3], salt), use_tqdm=False)
    assert_no_leak(tiny_llm.llm_engine)


@pytest.mark.slow
def test_chat_takes_a_cache_salt(smollm2_path):
    llm = LLM(smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=32 << 20, max_model_len=512)
    messages = [{"role": "user", "content": "Tell me about " + "harbours, ships, storms and sailors; " * 10}]

    def hits(salt: str) -> int:
        before = llm.llm_engine.get_stats().prefix_cache_hits
        llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False, cache_salt=salt)
        return llm.llm_engine.get_stats().prefix_cache_hits - before

    assert hits("a") == 0
    assert hits("b") == 0
    assert hits("a") >= 3 * 16


# -- the server ------------------------------------------------------------------------------------

QUERIES, HITS = "pagellm:prefix_cache_queries_total", "pagellm:prefix_cache_hits_total"


def _body(endpoint: str, text: str, **fields) -> tuple[str, dict]:
    if endpoint == "completions":
        return "/v1/completions", {"model": MODEL_NAME, "prompt": text, **fields}
    return "/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], **fields}


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_the_server_keeps_salted_prefixes_apart(smollm2_server, endpoint):
    url = smollm2_server.url
    # A prompt no other request on the shared server sent, long enough for several KV blocks.
    text = f"Note {uuid.uuid4().hex}: " + "the harbour keeps ships, storms and sailors; " * 12

    def send(salt: str) -> tuple[int, int]:
        """(prompt tokens, of which from the prefix cache), the latter read from /metrics."""
        before = metric_samples(url)
        path, body = _body(endpoint, text, cache_salt=salt, max_tokens=1, temperature=0.0)
        response = httpx.post(url + path, json=body, timeout=120.0)
        assert response.status_code == 200, response.text
        prompt_tokens = response.json()["usage"]["prompt_tokens"]
        after = metric_samples(url)
        assert after[QUERIES] - before[QUERIES] == prompt_tokens, "one prefix-cache lookup of the whole prompt"
        return prompt_tokens, after[HITS] - before[HITS]

    prompt_tokens, _ = send("a")
    assert prompt_tokens >= 6 * 16
    assert send("b")[1] == 0, "another salt finds nothing of the first request's blocks"
    assert send("a")[1] >= 5 * 16, "the same salt finds them"


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("salt", ["", 5])
def test_the_server_refuses_an_invalid_salt(smollm2_server, endpoint, salt):
    path, body = _body(endpoint, "hi", cache_salt=salt, max_tokens=1)
    response = httpx.post(smollm2_server.url + path, json=body, timeout=60.0)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == ("cache_salt", 400, "BadRequestError")
    assert "cache_salt" in error["message"]
