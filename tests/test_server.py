"""`pagellm serve` end to end: a real server process, the official `openai` client, raw HTTP for
malformed requests, Prometheus metrics, client disconnects and the API key."""
from __future__ import annotations

import asyncio
import socket
import time

import httpx
import openai
import pytest
from pydantic import TypeAdapter

from pagellm import LLM, SamplingParams
from pagellm.cli import main
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from pagellm.entrypoints.openai.protocol_anthropic import MessagesRequest
from pagellm.entrypoints.openai.protocol_embedding import EmbeddingRequest
from pagellm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagellm.entrypoints.openai.server_start import load_chat_template
from pagellm.sampling_params import RequestOutputKind
from conftest import SHARED_SERVER_FLAGS as ENGINE_FLAGS
from conftest import SHARED_SERVER_KV_BYTES as KV_BYTES
from conftest import SHARED_SERVER_MAX_LEN as MAX_LEN
from conftest import SHARED_SERVER_NAME as MODEL_NAME
from server_utils import RemoteServer, metric_samples

MAX_TOKENS = 16
QUESTIONS = [f"In one sentence, what is {topic}?" for topic in
             ("the sun", "a river", "music", "a library", "rain", "a bridge")]
DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(smollm2_path) -> LLM:
    return LLM(smollm2_path, device="cpu", dtype="float32", kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_LEN)


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def chat_messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {DEADLINE_S:.0f} s: {what}"
        time.sleep(0.1)


def wait_until_aborted_and_freed(server: RemoteServer, before: dict[str, float]) -> None:
    """One more aborted request than in `before`, none running, and no KV blocks in use."""
    def done() -> bool:
        now = metric_samples(server.url)
        return (now["pagellm:request_success_total{abort}"] == before["pagellm:request_success_total{abort}"] + 1
                and now["pagellm:num_requests_running"] == 0 and now["pagellm:kv_cache_usage_perc"] == 0)

    wait_until(done, "the request aborted and its KV blocks freed")


@pytest.mark.slow
def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == MAX_LEN
    assert models[0].model_extra["root"] == MODEL_NAME, "the served name, never the model's path on the server"


@pytest.mark.slow
def test_health_probes_answer_json(server):
    for probe in ("/health", "/health/live", "/health/ready"):
        response = httpx.get(f"{server.url}{probe}")
        assert response.status_code == 200 and response.headers["content-type"] == "application/json", probe
        assert response.json() == {"status": "ok"}, probe


@pytest.mark.slow
def test_chat_matches_offline_and_reports_usage(client, offline):
    ref = offline.chat(chat_messages(QUESTIONS[0]), greedy(), use_tqdm=False)[0]
    response = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages(QUESTIONS[0]),
                                              temperature=0.0, max_completion_tokens=MAX_TOKENS)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert response.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


@pytest.mark.slow
def test_completion_matches_offline_with_echo(client, offline):
    prompt = "The three primary colors are"
    ref = offline.generate(prompt, greedy(), use_tqdm=False)[0]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0, max_tokens=MAX_TOKENS)
    assert response.id.startswith("cmpl-") and response.object == "text_completion"
    assert response.choices[0].text == ref.outputs[0].text
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)
    echoed = client.completions.create(model=MODEL_NAME, prompt=ref.prompt_token_ids, temperature=0.0,
                                       max_tokens=MAX_TOKENS, echo=True)
    assert echoed.choices[0].text == prompt + ref.outputs[0].text


@pytest.mark.slow
def test_chat_stream_shape(client, offline):
    ref = offline.chat(chat_messages(QUESTIONS[1]), greedy(), use_tqdm=False)[0]
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=chat_messages(QUESTIONS[1]), temperature=0.0, max_tokens=MAX_TOKENS,
        stream=True, stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert chunks[0].choices[0].delta.role == "assistant"
    *content_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].delta.content or "" for c in content_chunks) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in content_chunks][-1] == ref.outputs[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content_chunks[:-1])
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == len(ref.outputs[0].token_ids)


@pytest.mark.slow
def test_completion_stream_deltas(client, offline):
    prompt = "Once upon a time"
    ref = offline.generate(prompt, greedy(), use_tqdm=False)[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0,
                                            max_tokens=MAX_TOKENS, stream=True))
    assert all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


CONCURRENT_QUESTIONS = [f"In one sentence, what is {topic}?" for topic in (
    "the sun", "a river", "music", "a library", "rain", "a bridge", "a volcano", "a violin", "winter", "a desert",
    "a lighthouse", "chess")]
CONCURRENT_PROMPTS = ["The first law of motion says", "A good breakfast has", "The best way to learn is",
                      "Once upon a time"]


@pytest.mark.slow
def test_concurrent_streams_match_offline(server, offline):
    """16 greedy requests streamed at once (chat and completions) give the offline engine's text."""
    async def stream_chat(client: openai.AsyncOpenAI, question: str) -> str:
        stream = await client.chat.completions.create(model=MODEL_NAME, messages=chat_messages(question),
                                                      temperature=0.0, max_tokens=MAX_TOKENS, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    async def stream_completion(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0,
                                                 max_tokens=MAX_TOKENS, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def run() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        chats = asyncio.gather(*[stream_chat(client, q) for q in CONCURRENT_QUESTIONS])
        completions = asyncio.gather(*[stream_completion(client, p) for p in CONCURRENT_PROMPTS])
        return await chats, await completions

    chats, completions = asyncio.run(run())
    expected_chats = offline.chat([chat_messages(q) for q in CONCURRENT_QUESTIONS], greedy(), use_tqdm=False)
    expected_completions = offline.generate(CONCURRENT_PROMPTS, greedy(), use_tqdm=False)
    assert chats == [out.outputs[0].text for out in expected_chats]
    assert completions == [out.outputs[0].text for out in expected_completions]


@pytest.mark.slow
def test_stop_token_ids(client, offline):
    prompt = "Count: one, two, three,"
    ref = offline.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0]
    stop_id = ref.token_ids[3]
    cut = ref.token_ids.index(stop_id)
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                         extra_body={"stop_token_ids": [stop_id]})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_id
    assert response.usage.completion_tokens == cut + 1
    assert ref.text.startswith(choice.text)


@pytest.mark.slow
def test_repeated_prompt_reports_cached_tokens(client):
    messages = chat_messages("Summarize the plot of a long novel about " + "ships and storms and sailors, " * 8)
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0.0)
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2, temperature=0.0)
    assert first.usage.prompt_tokens > 32
    assert second.usage.prompt_tokens_details.cached_tokens >= 32


@pytest.mark.slow
def test_tokenize_detokenize(server, client, offline):
    text = "Hello, paged attention!"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode(text)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_LEN
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == text
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": chat_messages(text)}).json()
    usage = client.chat.completions.create(model=MODEL_NAME, messages=chat_messages(text), max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens


@pytest.mark.slow
def test_metrics_parse_and_count_tokens(server, client):
    before = metric_samples(server.url)
    client.completions.create(model=MODEL_NAME, prompt="Metrics are", max_tokens=4, temperature=0.0)
    wait_until(lambda: metric_samples(server.url)["pagellm:generation_tokens_total"]
               >= before["pagellm:generation_tokens_total"] + 4, "generation tokens counted")
    after = metric_samples(server.url)
    assert after["pagellm:prompt_tokens_total"] > before["pagellm:prompt_tokens_total"]
    assert after["pagellm:request_success_total{length}"] == before["pagellm:request_success_total{length}"] + 1


@pytest.mark.slow
def test_client_disconnect_aborts_the_request(server):
    before = metric_samples(server.url)
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 900, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            data_lines = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(3):
                next(data_lines)
            assert metric_samples(server.url)["pagellm:num_requests_running"] == 1
    # Leaving the block closed the connection mid-stream.

    wait_until_aborted_and_freed(server, before)


@pytest.mark.slow
def test_client_timeout_aborts_a_non_streamed_request(server):
    before = metric_samples(server.url)
    body = {"model": MODEL_NAME, "prompt": "Tell me a very long story.", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": "gone-early"},
                   timeout=httpx.Timeout(30, read=1.5))

    wait_until_aborted_and_freed(server, before)
    # Logged as the client's departure (nginx's 499), not as a bad request.
    wait_until(lambda: "-> 499 [request id gone-early]" in server.log_tail(), "the 499 logged")
    assert "-> 400 [request id gone-early]" not in server.log_tail()


SCORED_PROMPTS = ["The capital of France is", "Water boils at"]


@pytest.mark.slow
def test_several_prompts_in_one_completion_request(client, offline):
    refs = offline.generate(SCORED_PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, n=2), use_tqdm=False)
    kwargs = dict(model=MODEL_NAME, prompt=SCORED_PROMPTS, temperature=0.0, max_tokens=6, n=2)
    response = client.completions.create(**kwargs)
    # OpenAI numbers the choices prompt by prompt: prompt i's j-th choice is index i * n + j.
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [o.text for ref in refs for o in ref.outputs]
    assert response.usage.prompt_tokens == sum(len(ref.prompt_token_ids) for ref in refs)
    assert response.usage.completion_tokens == sum(len(o.token_ids) for ref in refs for o in ref.outputs)
    texts = ["", "", "", ""]
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in response.choices]
    assert chunks[-1].usage.completion_tokens == response.usage.completion_tokens
    ids = [offline.get_tokenizer().encode(p) for p in SCORED_PROMPTS]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, temperature=0.0, max_tokens=6)
    assert [c.text for c in by_ids.choices] == [ref.outputs[0].text for ref in refs]


@pytest.mark.slow
def test_echo_with_max_tokens_zero_scores_the_prompt(client, offline):
    """The scoring idiom of lm-eval and others: the prompt's logprobs, nothing generated."""
    refs = offline.generate(SCORED_PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    kwargs = dict(model=MODEL_NAME, prompt=SCORED_PROMPTS, max_tokens=0, echo=True, logprobs=1)
    for response in (client.completions.create(**kwargs), *client.completions.create(**kwargs, stream=True)):
        for choice in response.choices:
            ref = refs[choice.index]
            assert choice.text == SCORED_PROMPTS[choice.index] and choice.finish_reason == "length"
            expected = [None] + [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
            assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    assert client.completions.create(**kwargs).usage.completion_tokens == 0


@pytest.mark.slow
def test_spec_nulls_ignored_fields_and_vllm_extras(server, client, offline):
    ref = offline.chat(chat_messages(QUESTIONS[4]), greedy(4), use_tqdm=False)[0]
    # What the openai SDK and others send: nulls for optional fields, and fields that change nothing here.
    body = {"model": MODEL_NAME, "messages": chat_messages(QUESTIONS[4]), "temperature": 0, "max_tokens": 4,
            "n": None, "presence_penalty": None, "frequency_penalty": None, "logprobs": None, "top_logprobs": None,
            "stop": None, "seed": None, "store": True, "metadata": {"team": "a"}, "service_tier": "auto",
            "reasoning_effort": "low", "parallel_tool_calls": False, "prompt_cache_key": "k", "user": "u",
            "safety_identifier": "s", "modalities": ["text"], "verbosity": "low", "return_token_ids": True,
            "stream_options": None}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=DEADLINE_S)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == ref.outputs[0].text
    assert choice["token_ids"] == ref.outputs[0].token_ids
    assert response.json()["prompt_token_ids"] == ref.prompt_token_ids
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=chat_messages(QUESTIONS[4]),
                                                 temperature=0, max_tokens=4, stream=True,
                                                 stream_options={"include_usage": True,
                                                                 "continuous_usage_stats": True}))
    # vLLM's continuous usage: every chunk carries the usage so far.
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage.prompt_tokens == len(ref.prompt_token_ids) for c in chunks)
    assert counts == sorted(counts) and counts[-1] == len(ref.outputs[0].token_ids) and counts[0] == 0


@pytest.mark.slow
def test_retrieve_model_and_tokenizer_info(server, client, offline):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    tokenizer = offline.get_tokenizer()
    assert (info["eos_token"], info["bos_token"]) == (tokenizer.eos_token, tokenizer.bos_token)
    assert info["chat_template"] == tokenizer.chat_template and info["model_max_length"] == MAX_LEN


LONG_PROMPT = "word " * (MAX_LEN + 50)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "tempreature": 0.5}, 400, "tempreature"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "gpt-4"),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, f"max_model_len is {MAX_LEN}"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, f"context of {MAX_LEN}"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs=true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}],
                              "parallel_tool_calls": False}, 400, "tools.0.function: Field required"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, "stream"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": [-1]}, 400, "vocabulary"),
])
def test_bad_request_gets_openai_error_and_server_keeps_serving(server, client, path, body, status, message):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    response = httpx.post(f"{server.url}{path}", **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["type"] == {400: "BadRequestError", 404: "NotFoundError"}[status]
    assert message in error["message"]
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=1).choices[0].text is not None


@pytest.mark.slow
def test_stop_string(client, offline):
    prompt = "Count: one, two, three,"
    ref = offline.generate(prompt, greedy(), use_tqdm=False)[0].outputs[0].text
    stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    response = client.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0.0, max_tokens=MAX_TOKENS,
                                         stop=["never appears", stop])
    choice = response.choices[0]
    assert (choice.text, choice.finish_reason) == (ref[:ref.index(stop)], "stop")
    assert choice.model_extra["stop_reason"] == stop


@pytest.mark.slow
def test_n_seeded_sampling_is_reproducible(client):
    def sample() -> tuple[list[str], int]:
        response = client.completions.create(model=MODEL_NAME, prompt="My favourite animal is", n=3, seed=7,
                                             temperature=1.0, max_tokens=4, extra_body={"ignore_eos": True})
        assert [c.index for c in response.choices] == [0, 1, 2]
        assert all(c.finish_reason == "length" for c in response.choices)
        return [c.text for c in response.choices], response.usage.completion_tokens

    texts, completion_tokens = sample()
    assert completion_tokens == 3 * 4, "usage counts every choice"
    assert sample() == (texts, completion_tokens)


@pytest.mark.slow
def test_streamed_n_matches_non_streamed(client):
    kwargs = dict(model=MODEL_NAME, messages=chat_messages(QUESTIONS[2]), n=2, seed=3, temperature=1.0,
                  max_tokens=8)
    expected = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, finishes = ["", ""], [[], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finishes[choice.index].append(choice.finish_reason)
    assert texts == [c.message.content for c in expected.choices]
    assert finishes == [[c.finish_reason] for c in expected.choices], "one finish_reason chunk per choice"
    assert chunks[-1].usage.completion_tokens == expected.usage.completion_tokens


@pytest.mark.slow
def test_chat_logprobs_match_offline(client, offline):
    ref = offline.chat(chat_messages(QUESTIONS[3]), SamplingParams(temperature=0.0, max_tokens=8, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    kwargs = dict(model=MODEL_NAME, messages=chat_messages(QUESTIONS[3]), temperature=0.0, max_tokens=8,
                  logprobs=True, top_logprobs=3)
    content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [item for chunk in client.chat.completions.create(**kwargs, stream=True)
                if chunk.choices[0].logprobs is not None for item in chunk.choices[0].logprobs.content]
    assert [item.token for item in streamed] == [item.token for item in content]
    assert [item.logprob for item in streamed] == pytest.approx([item.logprob for item in content], abs=1e-4)
    assert "".join(item.token for item in content) == ref.text
    for item, token_id, entry in zip(content, ref.token_ids, ref.logprobs, strict=True):
        assert item.logprob == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert bytes(item.bytes).decode() == item.token
        top = sorted(entry.values(), key=lambda lp: lp.logprob, reverse=True)[:3]
        assert [t.token for t in item.top_logprobs] == [lp.decoded_token for lp in top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([lp.logprob for lp in top], abs=1e-4)


@pytest.mark.slow
def test_completion_logprobs_with_echo(client, offline):
    prompt = "The capital of France is"
    ref = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, prompt_logprobs=2),
                           use_tqdm=False)[0]
    kwargs = dict(model=MODEL_NAME, prompt=prompt, temperature=0.0, max_tokens=4, logprobs=2, echo=True)
    choice = client.completions.create(**kwargs).choices[0]
    lp = choice.logprobs
    token_ids = ref.prompt_token_ids + ref.outputs[0].token_ids
    assert len(lp.tokens) == len(token_ids) and "".join(lp.tokens) == choice.text == prompt + ref.outputs[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "nothing predicts the first token"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for i, (token_id, entry) in enumerate(zip(token_ids[1:], ref.prompt_logprobs[1:] + ref.outputs[0].logprobs),
                                          start=1):
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        assert 2 <= len(lp.top_logprobs[i]) <= 3
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


@pytest.mark.slow
def test_prompt_logprobs_and_truncation(client):
    response = client.completions.create(model=MODEL_NAME, prompt="one two three four five six seven", max_tokens=1,
                                         extra_body={"truncate_prompt_tokens": 4, "prompt_logprobs": 1})
    assert response.usage.prompt_tokens == 4
    prompt_logprobs = response.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_logprobs) == 4 and prompt_logprobs[0] is None
    assert all(set(v) == {"logprob", "rank", "decoded_token"} for entry in prompt_logprobs[1:] for v in entry.values())


def test_vllm_extras_reach_sampling_params():
    extras = dict(min_tokens=2, bad_words=["cat"], allowed_token_ids=[5, 6, 7], logit_bias={"6": 3.5},
                  presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.1, truncate_prompt_tokens=9,
                  prompt_logprobs=1, include_stop_str_in_output=True, top_k=4, min_p=0.1)
    params = CompletionRequest(prompt="x", best_of=2, logprobs=1, **extras).to_sampling_params(16)
    assert {name: getattr(params, name) for name in extras} == {**extras, "logit_bias": {6: 3.5}}
    assert (params.best_of, params.logprobs, params.output_kind) == (2, 1, RequestOutputKind.CUMULATIVE)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=3,
                                 stream=True).to_sampling_params(None)
    assert (chat.logprobs, chat.output_kind) == (3, RequestOutputKind.DELTA)


def test_strict_types_still_take_every_legitimate_form():
    """Strict request types refuse a string for a boolean or number, but keep the forms OpenAI's and
    Anthropic's APIs define: an integer for a float, unions, enums as strings, string keys, schemas as objects."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    completion = CompletionRequest.model_validate({
        "prompt": [[1, 2], [3]], "temperature": 1, "top_p": 1, "stop": "x", "logit_bias": {"6": 1}, "seed": 0,
        "stream": True, "stream_options": {"include_usage": True}, "structured_outputs": {"json": schema}})
    assert (completion.temperature, completion.stop, completion.logit_bias) == (1.0, ["x"], {"6": 1.0})
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}]
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "hi", "name": "bob"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "content": "2", "tool_call_id": "c"}]
    for tool_choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        chat = ChatCompletionRequest.model_validate({
            "messages": messages, "tools": tools, "tool_choice": tool_choice, "max_completion_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
            "chat_template_kwargs": {"enable_thinking": False}, "frequency_penalty": 0})
        assert chat.max_tokens_field() == (5, "max_completion_tokens")
    assert EmbeddingRequest.model_validate({"input": [[1, 2]], "encoding_format": "base64",
                                            "normalize": False}).encoding_format == "base64"
    assert ResponsesRequest.model_validate({"input": "hi", "truncation": "auto", "temperature": 0,
                                            "text": {"format": {"type": "text"}}}).temperature == 0.0
    assert MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "temperature": 1, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]})
    assert TypeAdapter(TokenizeRequest).validate_python({"prompt": "hi", "add_special_tokens": False})


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_too_many_logprobs_is_a_400_naming_the_field(server, path, body, param):
    response = httpx.post(f"{server.url}{path}", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert f"{param} must be at most 20" in error["message"]


@pytest.mark.slow
def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL_NAME, messages=chat_messages("hi"), temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi")


@pytest.mark.slow
def test_api_key(smollm2_path):
    remote = RemoteServer(smollm2_path, *ENGINE_FLAGS, "--api-key", "s3cret")
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            response = httpx.get(f"{remote.url}/v1/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "AuthenticationError"
        response = httpx.post(f"{remote.url}/v1/completions", content=b"{broken", headers={})
        assert response.status_code == 401, "the key is checked before the body"
        for open_path in ("/health", "/metrics", "/version"):
            assert httpx.get(f"{remote.url}{open_path}").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{remote.url}/v1", api_key="wrong", max_retries=0).models.list()
        authorized = openai.OpenAI(base_url=f"{remote.url}/v1", api_key="s3cret", max_retries=0)
        assert authorized.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).usage.completion_tokens
        assert "s3cret" not in remote.log_tail(100_000)
    finally:
        assert remote.stop() == 0


def test_chat_template_flag_takes_a_file_or_an_inline_template(tmp_path):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="syntax error"):
        load_chat_template("{% for m in messages %}")


def test_busy_port_fails_before_the_model_loads(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve", "--port", str(busy.getsockname()[1])]) == 2
    assert "choose another --port" in capsys.readouterr().err
