"""/v1/responses (OpenAI's Responses API) and /v1/messages (Anthropic's Messages API) end to end,
with the official `openai` and `anthropic` clients against a real server: greedy output equals
/v1/chat/completions on the same conversation, streams equal non-streamed output, and errors take
each API's shape."""
from __future__ import annotations

import asyncio
import functools

import anthropic
import httpx
import openai
import pydantic
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pagellm.entrypoints.openai.auth import APIKeyMiddleware
from conftest import SHARED_SERVER_NAME as MODEL_NAME
MAX_TOKENS = 16
QUESTION = "In one sentence, what is the sun?"
SHORT = "What is the capital of France?"  # answered greedily in 8 tokens
GREEDY = {"extra_body": {"temperature": 0}}
"""The anthropic client (2.x) has no `temperature` argument any more; the API still takes the field."""
SYSTEM = "You are a helpful assistant who answers briefly."


@pytest.fixture(scope="module")
def server(smollm2_server):
    return smollm2_server


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def chat(oai):
    """Greedy /v1/chat/completions on a conversation: (text, finish_reason, prompt_tokens), cached."""
    @functools.cache
    def run(messages: tuple[tuple[str, str], ...], max_tokens: int = MAX_TOKENS) -> tuple[str, str, int]:
        r = oai.chat.completions.create(model=MODEL_NAME, messages=[{"role": role, "content": content}
                                                                    for role, content in messages],
                                        temperature=0, max_tokens=max_tokens)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.prompt_tokens

    return run


# -- /v1/responses -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_responses_string_input_matches_chat(oai, chat):
    text, finish_reason, prompt_tokens = chat((("user", QUESTION),))
    r = oai.responses.create(model=MODEL_NAME, input=QUESTION, temperature=0, max_output_tokens=MAX_TOKENS)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert r.output_text == text and text
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens == prompt_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if finish_reason == "length" else "completed")


@pytest.mark.slow
def test_responses_instructions_limit_and_continuation(oai, chat):
    first = oai.responses.create(model=MODEL_NAME, instructions=SYSTEM, temperature=0, max_output_tokens=4,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    text, _, prompt_tokens = chat((("system", SYSTEM), ("user", QUESTION)), 4)
    assert first.output_text == text and first.usage.input_tokens == prompt_tokens
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.usage.output_tokens == 4

    # The earlier turn (not its instructions, as in OpenAI's API) comes before the new input.
    follow_up = "Say it again."
    second = oai.responses.create(model=MODEL_NAME, previous_response_id=first.id, input=follow_up,
                                  temperature=0, max_output_tokens=8)
    text, _, prompt_tokens = chat((("user", QUESTION), ("assistant", first.output_text), ("user", follow_up)), 8)
    assert second.output_text == text
    assert second.usage.input_tokens == prompt_tokens > first.usage.input_tokens
    assert second.previous_response_id == first.id

    unstored = oai.responses.create(model=MODEL_NAME, input=QUESTION, max_output_tokens=1, store=False)
    for missing in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError) as e:
            oai.responses.create(model=MODEL_NAME, previous_response_id=missing, input="Hi", max_output_tokens=1)
        assert e.value.body["param"] == "previous_response_id"


@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "status"), [(SHORT, "completed"), (QUESTION, "incomplete")])
def test_responses_stream_matches_non_streamed(oai, chat, prompt, status):
    text, _, _ = chat((("user", prompt),))
    with oai.responses.stream(model=MODEL_NAME, input=prompt, temperature=0,
                              max_output_tokens=MAX_TOKENS) as stream:
        events = list(stream)
        # As OpenAI's API does, a response cut short ends with response.incomplete, which the
        # client's get_final_response() does not accept.
        final = stream.get_final_response() if status == "completed" else events[-1].response
    assert final.status == status
    types = [e.type for e in events]
    last = f"response.{status}"
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          last]
    assert types.count("response.output_text.delta") > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == text == final.output_text
    assert events[-1].response.usage.output_tokens == final.usage.output_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0.type"),
])
def test_responses_refuses_what_it_cannot_do(oai, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**{"model": MODEL_NAME, "input": "Hi", **extra})
    assert e.value.body["param"] == param


class City(pydantic.BaseModel):
    city: str


@pytest.mark.slow
def test_responses_parse_into_a_pydantic_model(oai):
    """text.format json_schema (what `responses.parse` sends) constrains the output as chat's response_format."""
    response = oai.responses.parse(model=MODEL_NAME, input=SHORT, text_format=City, temperature=0,
                                   max_output_tokens=32)
    assert response.status == "completed" and isinstance(response.output_parsed, City), response.output_text


# -- /v1/messages --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_messages_match_chat_and_stop_reasons(claude, chat):
    messages = [{"role": "user", "content": QUESTION}]
    m = claude.messages.create(model=MODEL_NAME, system=SYSTEM, messages=messages, max_tokens=MAX_TOKENS,
                               **GREEDY)
    text, finish_reason, prompt_tokens = chat((("system", SYSTEM), ("user", QUESTION)))
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL_NAME
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text
    assert m.stop_reason == ("max_tokens" if finish_reason == "length" else "end_turn")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt_tokens
    counted = claude.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=messages)
    assert counted.input_tokens == prompt_tokens

    short = claude.messages.create(model=MODEL_NAME, system=[{"type": "text", "text": SYSTEM}], max_tokens=2,
                                   messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
                                   **GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2
    assert text.startswith(short.content[0].text)

    word = text.split()[2]  # a stop string the greedy answer reaches after a few tokens
    stopped = claude.messages.create(model=MODEL_NAME, system=SYSTEM, messages=messages, max_tokens=MAX_TOKENS,
                                     stop_sequences=[word], **GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[:text.index(word)]


@pytest.mark.slow
def test_messages_stream_matches_non_streamed(claude):
    kwargs = {"model": MODEL_NAME, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_TOKENS,
              **GREEDY}
    m = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        chunks = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(chunks) > 1 and "".join(chunks) == m.content[0].text == final.content[0].text
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


@pytest.mark.slow
def test_messages_errors_in_anthropics_shape(claude, server):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL_NAME, max_tokens=1, messages=[{"role": "user", "content": [image]}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content" in e.value.body["error"]["message"]

    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-unknown", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-unknown" in e.value.body["error"]["message"]

    for body, field in (({"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
                        ({"model": MODEL_NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}],
                          "tools": [{"name": "f", "input_schema": {}}]}, "tools")):
        r = httpx.post(f"{server.url}/v1/messages", json=body)
        # Anthropic's documented error, as the anthropic SDK's own model of it reads it.
        error = anthropic.types.ErrorResponse.model_validate(r.json())
        assert r.status_code == 400 and set(r.json()) == {"type", "error", "request_id"}
        assert error.error.type == "invalid_request_error" and field in error.error.message
        assert error.request_id == r.headers["X-Request-Id"]
    # Other routes keep OpenAI's shape.
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL_NAME})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_api_key_also_accepted_as_x_api_key():
    async def ok(request):
        return PlainTextResponse("ok")

    app = APIKeyMiddleware(Starlette(routes=[Route("/v1/messages", ok, methods=["POST"])]), api_key="s3cret",
                           open_paths=frozenset())

    async def post(headers: dict[str, str]) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/messages", headers=headers)

    assert asyncio.run(post({"x-api-key": "s3cret"})).status_code == 200
    assert asyncio.run(post({"authorization": "Bearer s3cret"})).status_code == 200
    denied = asyncio.run(post({"x-api-key": "wrong"}))
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
