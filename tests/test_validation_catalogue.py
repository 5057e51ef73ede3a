"""Edge validation against one live server: a catalogue of bad requests, each answered with a 4xx in
OpenAI's error shape that quotes its request id (never a 5xx), while a good streamed request runs
beside them unharmed; then X-Request-Id handling and the body-size limit on the wire. The server
also runs a reasoning parser, whose effect on chat answers is checked here too (it changes nothing
the catalogue relies on)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import tokenizers
from catalogue_utils import TIMEOUT_S, Case, mismatch, send
from engine_utils import wait_for
from server_utils import RemoteServer, is_idle, metric_samples
from starlette.testclient import TestClient

from pagellm.config.multimodal import MultiModalConfig
from pagellm.entrypoints.openai.errors import APIError
from pagellm.entrypoints.openai.limits import ServerLimits
from pagellm.entrypoints.openai.middleware import BodySizeLimitMiddleware, RequestIdMiddleware
from pagellm.entrypoints.openai.protocol import ChatPromptFields
from pagellm.entrypoints.openai.serving_base import OpenAIServing
from pagellm.tokenizer import Tokenizer

MODEL = "smollm2"
MAX_LEN = 256
MAX_BODY = 64 << 10
MAX_N, MAX_STOP, MAX_LOGPROBS, MAX_PROMPTS = 4, 4, 5, 3
MAX_GRAMMAR = 4096
FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(48 << 20),
         "--max-model-len", str(MAX_LEN), "--served-model-name", MODEL, "--max-request-body-bytes", str(MAX_BODY),
         "--max-n", str(MAX_N), "--max-stop-sequences", str(MAX_STOP), "--max-logprobs", str(MAX_LOGPROBS),
         "--max-prompts", str(MAX_PROMPTS), "--structured-outputs-max-bytes", str(MAX_GRAMMAR),
         "--reasoning-parser", "deepseek_r1")
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]
LONG = "word " * (MAX_LEN + 20)
GOOD_STREAM = {"model": MODEL, "prompt": "The history of the printing press", "max_tokens": 32,
               "temperature": 0.0, "ignore_eos": True, "stream": True}


FUNCTION = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOL = {"type": "function", "function": FUNCTION}


def tool_with(parameters: dict) -> dict:
    return {"type": "function", "function": {**FUNCTION, "parameters": parameters}}


def named(function: str) -> dict:
    return {"type": "function", "function": {"name": function}}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def cmpl(**fields: Any) -> dict:
    return {"prompt": "hi", **fields}


def chat(**fields: Any) -> dict:
    return {"messages": HI, **fields}


def oversized_chunks() -> Iterator[bytes]:
    """A valid JSON body over MAX_BODY, sent chunked (no Content-Length)."""
    yield b'{"prompt": "'
    for _ in range(MAX_BODY // 4096 + 1):
        yield b"x" * 4096
    yield b'"}'


CATALOGUE = [
    # Bodies that are not JSON a request can be made of.
    Case("syntax", CMPL, b"{not json", 400, "not valid JSON"),
    Case("invalid utf-8", CMPL, b'{"prompt": "caf\xe9"}', 400, "not valid UTF-8"),
    Case("lone surrogate", CMPL, b'{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate", "prompt"),
    Case("surrogate in a message", CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400,
         "lone UTF-16 surrogate", "messages.0.content"),
    Case("top-level array", CMPL, b"[1, 2]", 400, "valid dictionary"),
    Case("nested too deeply", CMPL, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    Case("5000-digit number", CMPL, b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}", 400, "could not be parsed"),
    Case("NaN", CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, "finite number", "temperature"),
    Case("Infinity", CMPL, b'{"prompt": "hi", "repetition_penalty": Infinity}', 400, "finite number",
         "repetition_penalty"),
    Case("not JSON content type", CMPL, b"prompt=hi", 400, "Content-Type: application/json",
         headers={"content-type": "application/x-www-form-urlencoded"}),
    # Wrong types, missing and unknown fields.
    Case("prompt type", CMPL, {"prompt": 5}, 400, "prompt", "prompt.str"),
    Case("prompt missing", CMPL, {"max_tokens": 5}, 400, "Field required", "prompt"),
    Case("messages type", CHAT, {"messages": "hello"}, 400, "valid list", "messages"),
    Case("messages missing", CHAT, {"max_tokens": 5}, 400, "Field required", "messages"),
    Case("max_tokens type", CMPL, cmpl(max_tokens="many"), 400, "valid integer", "max_tokens"),
    Case("stream type", CMPL, cmpl(stream="perhaps"), 400, "valid boolean", "stream"),
    # A JSON string is never a boolean or a number, however it reads (OpenAI's API refuses them too).
    Case("stream as a string", CMPL, cmpl(stream="yes"), 400, "valid boolean", "stream"),
    Case("max_tokens as a string", CMPL, cmpl(max_tokens="10"), 400, "valid integer", "max_tokens"),
    Case("echo as a string", CMPL, cmpl(echo="true"), 400, "valid boolean", "echo"),
    Case("max_completion_tokens as a string", CHAT, chat(max_completion_tokens="5"), 400, "valid integer",
         "max_completion_tokens"),
    Case("n as a fraction", CHAT, chat(n=1.5), 400, "valid integer", "n"),
    Case("n as a whole float", CMPL, cmpl(n=2.0), 400, "valid integer", "n"),
    Case("temperature as a string", CHAT, chat(temperature="0.5"), 400, "valid number", "temperature"),
    Case("embeddings normalize as a string", "/v1/embeddings", {"input": "hi", "normalize": "yes"}, 400,
         "valid boolean", "normalize"),
    Case("responses stream as a string", "/v1/responses", {"input": "hi", "stream": "yes"}, 400, "valid boolean",
         "stream"),
    Case("tokenize add_special_tokens as a string", "/tokenize", {"prompt": "hi", "add_special_tokens": "yes"}, 400,
         "valid boolean", "completion.add_special_tokens"),
    Case("detokenize id as a string", "/detokenize", {"tokens": ["1"]}, 400, "valid integer", "tokens.0"),
    Case("unknown field", CMPL, cmpl(tempreature=0.5), 400, "Extra inputs are not permitted", "tempreature"),
    Case("logit_bias type", CMPL, cmpl(logit_bias=[1, 2]), 400, "valid dictionary", "logit_bias"),
    # Sampling values out of range.
    Case("temperature", CMPL, cmpl(temperature=-1), 400, "temperature must be", "temperature"),
    Case("top_p", CHAT, chat(top_p=1.5), 400, "top_p must be in (0, 1]", "top_p"),
    Case("top_k", CMPL, cmpl(top_k=-2), 400, "top_k must be", "top_k"),
    Case("min_p", CMPL, cmpl(min_p=2), 400, "min_p must be", "min_p"),
    Case("presence_penalty", CMPL, cmpl(presence_penalty=3), 400, "[-2.0, 2.0]", "presence_penalty"),
    Case("frequency_penalty", CHAT, chat(frequency_penalty=-2.5), 400, "[-2.0, 2.0]", "frequency_penalty"),
    Case("repetition_penalty", CMPL, cmpl(repetition_penalty=0), 400, "> 0", "repetition_penalty"),
    Case("max_completion_tokens 0", CHAT, chat(max_completion_tokens=0), 400,
         "max_completion_tokens must be a positive integer", "max_completion_tokens"),
    Case("seed beyond 64 bits", CMPL, cmpl(seed=2 ** 70), 400, "less than or equal to", "seed"),
    Case("negative seed", CMPL, cmpl(seed=-1), 400, "greater than or equal to 0", "seed"),
    Case("min_tokens over max_tokens", CMPL, cmpl(min_tokens=9, max_tokens=4), 400, "min_tokens (9)", "min_tokens"),
    Case("truncate_prompt_tokens", CMPL, cmpl(truncate_prompt_tokens=0), 400, "positive integer",
         "truncate_prompt_tokens"),
    # Counts over the server's limits.
    Case("n 0", CMPL, cmpl(n=0), 400, "n must be a positive integer", "n"),
    Case("n over --max-n", CHAT, chat(n=MAX_N + 1), 400, f"n must be at most {MAX_N}", "n"),
    Case("best_of over --max-n", CMPL, cmpl(best_of=MAX_N + 1), 400, f"best_of must be at most {MAX_N}", "best_of"),
    Case("best_of under n", CMPL, cmpl(n=3, best_of=2), 400, "best_of must be an integer >= n", "best_of"),
    Case("stop over --max-stop-sequences", CMPL, cmpl(stop=[f"s{i}" for i in range(MAX_STOP + 1)]), 400,
         f"at most {MAX_STOP} strings", "stop"),
    Case("empty stop string", CMPL, cmpl(stop=["ok", ""]), 400, "stop must be", "stop"),
    Case("logprobs over --max-logprobs", CMPL, cmpl(logprobs=MAX_LOGPROBS + 1), 400,
         f"logprobs must be at most {MAX_LOGPROBS}", "logprobs"),
    Case("top_logprobs over --max-logprobs", CHAT, chat(logprobs=True, top_logprobs=MAX_LOGPROBS + 1), 400,
         f"top_logprobs must be at most {MAX_LOGPROBS}", "top_logprobs"),
    Case("prompt_logprobs over --max-logprobs", CMPL, cmpl(prompt_logprobs=MAX_LOGPROBS + 1), 400,
         f"prompt_logprobs must be at most {MAX_LOGPROBS}", "prompt_logprobs"),
    Case("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), 400, "needs logprobs=true", "top_logprobs"),
    # Prompts: empty, outside the vocabulary, too long.
    Case("empty prompt", CMPL, cmpl(prompt=""), 400, "prompt is empty", "prompt"),
    Case("empty token prompt", CMPL, cmpl(prompt=[]), 400, "prompt is empty", "prompt"),
    Case("token id over the vocabulary", CMPL, cmpl(prompt=[1, 10 ** 6]), 400, "outside the vocabulary", "prompt"),
    Case("negative token id", CMPL, cmpl(prompt=[-1]), 400, "outside the vocabulary", "prompt"),
    Case("prompt over max_model_len", CMPL, cmpl(prompt=LONG), 400, f"max_model_len is {MAX_LEN}", "prompt"),
    Case("prompt + max_tokens over max_model_len", CMPL, cmpl(max_tokens=MAX_LEN), 400, f"context of {MAX_LEN}",
         "max_tokens"),
    Case("messages over max_model_len", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400,
         f"max_model_len is {MAX_LEN}", "messages"),
    # Messages.
    Case("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'user'", "messages.0.role"),
    Case("image content part to a text-only model", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
         "messages[0].content[0]: this model takes text only", "messages"),
    Case("audio content part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]}, 400,
         "only text and image_url content parts", "messages.0.content.0"),
    Case("content type", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "a list of text parts",
         "messages.0.content"),
    Case("content missing", CHAT, {"messages": [{"role": "assistant"}]}, 400, "got nothing", "messages.0.content"),
    Case("no messages", CHAT, {"messages": []}, 400, "at least 1 item", "messages"),
    Case("continue and add_generation_prompt", CHAT, chat(continue_final_message=True), 400,
         "cannot both be true", "continue_final_message"),
    Case("chat_template_kwargs clash", CHAT, chat(chat_template_kwargs={"messages": []}), 400, "may not set messages",
         "chat_template_kwargs"),
    Case("chat_template_kwargs tools", CHAT, chat(chat_template_kwargs={"tools": "x"}), 400, "may not set tools",
         "chat_template_kwargs"),
    # logit_bias and other token id lists.
    Case("logit_bias key not a token id", CMPL, cmpl(logit_bias={"abc": 1}), 400, "keys must be token ids",
         "logit_bias"),
    Case("logit_bias negative key", CMPL, cmpl(logit_bias={"-5": 1}), 400, "outside the vocabulary", "logit_bias"),
    Case("logit_bias key over the vocabulary", CHAT, chat(logit_bias={"999999": 1}), 400, "outside the vocabulary",
         "logit_bias"),
    Case("logit_bias value", CMPL, cmpl(logit_bias={"5": 101}), 400, "[-100, 100]", "logit_bias"),
    Case("stop_token_ids over the vocabulary", CMPL, cmpl(stop_token_ids=[10 ** 6]), 400, "outside the vocabulary",
         "stop_token_ids"),
    Case("empty allowed_token_ids", CMPL, cmpl(allowed_token_ids=[]), 400, "must not be empty", "allowed_token_ids"),
    # Tools, tool_choice and output constraints.
    Case("tool without function", CHAT, chat(tools=[{"type": "function"}]), 400, "Field required", "tools.0.function"),
    Case("tool beside an unknown field", CHAT, chat(tools=[{"type": "function"}], parallel_tool_calls=False,
                                                    tempreature=1), 400, "Field required", "tools.0.function"),
    Case("tool of another type", CHAT, chat(tools=[{"type": "custom", "function": FUNCTION}]), 400, "'function'",
         "tools.0.type"),
    Case("empty tools", CHAT, chat(tools=[]), 400, "must not be empty", "tools"),
    Case("two tools of one name", CHAT, chat(tools=[TOOL, TOOL], tool_choice="required"), 400, "more than one",
         "tools"),
    Case("tool_choice required without tools", CHAT, chat(tool_choice="required"), 400, "needs tools", "tool_choice"),
    Case("tool_choice auto without the server flags", CHAT, chat(tools=[TOOL]), 400, "--enable-auto-tool-choice",
         "tool_choice"),
    Case("tool_choice of an unknown function", CHAT, chat(tools=[TOOL], tool_choice=named("get_time")), 400,
         "'get_time', which is not among tools", "tool_choice"),
    Case("tool_choice without a name", CHAT, chat(tools=[TOOL], tool_choice={"type": "function", "function": {}}),
         400, "Field required", "tool_choice.function.name"),
    Case("tool_choice word", CHAT, chat(tools=[TOOL], tool_choice="any"), 400, '"required" or', "tool_choice"),
    Case("functions (deprecated)", CHAT, chat(functions=[FUNCTION]), 400, "send `tools`", "functions"),
    Case("tool parameters that no grammar can follow", CHAT,
         chat(tools=[tool_with({"type": "object", "properties": {"a": {"type": 5}}})],
              tool_choice=named("get_weather")), 400, "parameters of function 'get_weather' is not supported",
         "tools[0].function.parameters"),
    Case("assistant message without content or tool calls", CHAT, {"messages": [
        {"role": "assistant", "content": None, "tool_calls": []}]}, 400, "got nothing", "messages.0.content"),
    Case("response_format type", CHAT, chat(response_format={"type": "xml"}), 400, "'json_schema'",
         "response_format.type"),
    Case("json_schema without schema", CHAT,
         chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "Field required",
         "response_format.json_schema.schema"),
    Case("invalid JSON schema", CHAT, chat(response_format=json_schema({"type": "nonsense"})), 400,
         "the JSON schema is not supported", "response_format.json_schema.schema"),
    Case("JSON schema over --structured-outputs-max-bytes", CMPL,
         cmpl(guided_json={"enum": ["x" * 100] * (MAX_GRAMMAR // 100)}), 400,
         "--structured-outputs-max-bytes", "guided_json"),
    Case("guided_regex that does not parse", CMPL, cmpl(guided_regex="(a"), 400, "regular expression is not supported",
         "guided_regex"),
    Case("grammar that does not parse", CMPL, cmpl(structured_outputs={"grammar": "root ::= x"}), 400,
         "grammar is not supported", "structured_outputs.grammar"),
    Case("structured_outputs with two kinds", CMPL, cmpl(structured_outputs={"regex": "a", "choice": ["a"]}), 400,
         "exactly one of", "structured_outputs"),
    Case("structured_outputs unknown key", CMPL, cmpl(structured_outputs={"regexp": "a"}), 400, "Extra inputs",
         "structured_outputs.regexp"),
    Case("empty guided_choice", CMPL, cmpl(guided_choice=[]), 400, "at least 1 item", "guided_choice"),
    Case("two constraints", CMPL, cmpl(response_format={"type": "json_object"}, guided_regex="a+"), 400,
         "`response_format` and `guided_regex` both constrain", "guided_regex"),
    Case("tool_choice beside a constraint", CHAT, chat(structured_outputs={"choice": ["a"]}, tools=[TOOL],
                                                       tool_choice="required"), 400,
         "`structured_outputs` and `tools` both constrain", "tools"),
    Case("guided_decoding_backend", CMPL, cmpl(guided_decoding_backend="outlines"), 400, "only one is xgrammar",
         "guided_decoding_backend"),
    Case("guided_whitespace_pattern", CHAT, chat(guided_whitespace_pattern=r"\s*"), 400, "disable_any_whitespace",
         "guided_whitespace_pattern"),
    # Fields the server does not implement, and inconsistent ones.
    Case("audio output", CHAT, chat(modalities=["text", "audio"]), 400, "outputs text", "modalities"),
    Case("priority", CMPL, cmpl(priority=1), 400, "first come, first served", "priority"),
    Case("priority in chat", CHAT, chat(priority=-1), 400, "--scheduling-policy priority", "priority"),
    Case("suffix", CMPL, cmpl(suffix="!"), 400, "`suffix` is not supported", "suffix"),
    Case("max_tokens 0 without echo", CMPL, cmpl(max_tokens=0), 400, "only allowed with echo", "max_tokens"),
    Case("negative max_tokens", CMPL, cmpl(max_tokens=-1), 400, "greater than or equal to 0", "max_tokens"),
    Case("empty prompt list", CMPL, {"prompt": []}, 400, "prompt is empty", "prompt"),
    Case("too many prompts", CMPL, {"prompt": ["a"] * (MAX_PROMPTS + 1)}, 400, "--max-prompts", "prompt"),
    Case("one bad prompt of several", CMPL, {"prompt": [[1, 2], [10 ** 6]]}, 400, "outside the vocabulary", "prompt"),
    Case("null messages", CHAT, {"messages": None}, 400, "Field required", "messages"),
    Case("stream_options without stream", CMPL, cmpl(stream_options={"include_usage": True}), 400,
         "only allowed with stream=true", "stream_options"),
    Case("prompt_logprobs with stream", CMPL, cmpl(prompt_logprobs=1, stream=True), 400, "stream",
         "prompt_logprobs"),
    Case("request_id with a space", CMPL, cmpl(request_id="a b"), 400, "should match pattern", "request_id"),
    Case("empty responses input", "/v1/responses", {"input": ""}, 400, "input is empty", "input"),
    # Unknown models.
    Case("unknown model, completions", CMPL, cmpl(model="gpt-4"), 404, "`gpt-4` does not exist", "model"),
    Case("unknown model, chat", CHAT, chat(model="gpt-4"), 404, "does not exist", "model"),
    Case("unknown model, tokenize", "/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist", "model"),
    # /tokenize, /detokenize, /v1/models.
    Case("tokenize without prompt", "/tokenize", {}, 400, "either `prompt` (text) or `messages`"),
    Case("tokenize prompt and messages", "/tokenize", {"prompt": "hi", "messages": HI}, 400, "either `prompt`"),
    Case("tokenize unknown role", "/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "'user'",
         "chat.messages.0.role"),
    Case("tokenize lone surrogate", "/tokenize", b'{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate",
         "completion.prompt"),
    Case("detokenize negative id", "/detokenize", {"tokens": [-1]}, 400, "outside the vocabulary", "tokens"),
    Case("detokenize id beyond 64 bits", "/detokenize", {"tokens": [2 ** 70]}, 400, "less than or equal to",
         "tokens.0"),
    Case("detokenize id type", "/detokenize", {"tokens": ["a"]}, 400, "valid integer", "tokens.0"),
    Case("models by POST", "/v1/models", {}, 405, "Method Not Allowed"),
    Case("unknown model, retrieve", "/v1/models/gpt-4", None, 404, "`gpt-4` does not exist", "model", method="GET"),
    Case("unknown path", "/v2/models", None, 404, "Not Found", method="GET"),
    # Bodies over --max-request-body-bytes, declared and chunked.
    Case("body over the limit", CMPL, cmpl(prompt="x" * MAX_BODY), 413, f"limit of {MAX_BODY} bytes"),
    Case("chunked body over the limit", CMPL, oversized_chunks, 413, f"limit of {MAX_BODY} bytes"),
]


@pytest.fixture(scope="module")
def server(smollm2_path):
    remote = RemoteServer(smollm2_path, *FLAGS)
    yield remote
    assert remote.stop() == 0, "the server did not shut down cleanly"


def stream_text(server: RemoteServer, started: threading.Event | None = None) -> str:
    """GOOD_STREAM's text, setting `started` once the first chunk is in."""
    text = ""
    with httpx.stream("POST", f"{server.url}{CMPL}", json=GOOD_STREAM, timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: "):])["choices"][0]["text"]
                if started is not None:
                    started.set()
    return text


@pytest.mark.slow
def test_catalogue_of_bad_requests_gets_4xx_and_harms_nothing(server):
    assert len(CATALOGUE) >= 40 and len({c.name for c in CATALOGUE}) == len(CATALOGUE)
    alone = stream_text(server)
    started, result = threading.Event(), {}
    beside = threading.Thread(target=lambda: result.update(text=stream_text(server, started)))
    beside.start()
    assert started.wait(timeout=TIMEOUT_S), "the good stream did not start"
    assert beside.is_alive(), "the good stream should still be running while the catalogue is sent"

    failures = {}
    for i, case in enumerate(CATALOGUE):
        request_id = f"catalogue-{i}"
        problem = mismatch(case, send(server.url, case, request_id), request_id)
        if problem is not None:
            failures[case.name] = problem
    beside.join(timeout=TIMEOUT_S)

    assert not failures, "\n".join(f"{name}: {problem}" for name, problem in failures.items())
    assert result.get("text") == alone, "the good stream's text changed while bad requests were refused"
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT_S).status_code == 200
    asyncio.run(wait_for(lambda: is_idle(metric_samples(server.url))))
    log = server.log_tail(1_000_000)
    unlogged = [c.name for i, c in enumerate(CATALOGUE) if f"[request id catalogue-{i}]" not in log]
    assert not unlogged, f"no log line names these failed requests: {unlogged}"


@pytest.mark.slow
def test_request_id_is_echoed_or_generated(server):
    mine = httpx.post(f"{server.url}{CMPL}", json=cmpl(max_tokens=1), headers={"X-Request-Id": "client-id-7"},
                      timeout=TIMEOUT_S)
    assert mine.status_code == 200 and mine.headers["X-Request-Id"] == "client-id-7"
    assert mine.json()["id"] == "cmpl-client-id-7", "the engine request carries the client's id"
    for bad in ("x" * 129, "has space", "caf\u00e9"):
        response = httpx.get(f"{server.url}/v1/models", headers={"X-Request-Id": bad.encode("utf-8")},
                             timeout=TIMEOUT_S)
        generated = response.headers["X-Request-Id"]
        assert response.status_code == 200 and generated != bad and len(generated) == 32
    ours = httpx.post(f"{server.url}{CHAT}", json=chat(max_tokens=1), timeout=TIMEOUT_S)
    assert ours.json()["id"] == f"chatcmpl-{ours.headers['X-Request-Id']}"
    refused = httpx.post(f"{server.url}{CMPL}", json=cmpl(temperature=-1), timeout=TIMEOUT_S)
    assert f"(request id: {refused.headers['X-Request-Id']})" in refused.json()["error"]["message"]


@pytest.mark.slow
def test_reasoning_parser_separates_the_reasoning(server):
    """deepseek_r1's template opens the reasoning in the prompt, so everything before `</think>` is
    reasoning: SmolLM2 never writes one, so all its text is reasoning_content and there is no answer
    yet, in a response and in a stream alike."""
    body = chat(max_tokens=4, temperature=0.0)
    message = httpx.post(f"{server.url}{CHAT}", json=body, timeout=TIMEOUT_S).json()["choices"][0]["message"]
    assert message["content"] is None and message["reasoning_content"], message
    assert message["reasoning"] == message["reasoning_content"], "vLLM's newer name carries the same text"
    deltas = []
    with httpx.stream("POST", f"{server.url}{CHAT}", json={**body, "stream": True}, timeout=TIMEOUT_S) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[len("data: "):])["choices"][0]["delta"])
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert not "".join(d.get("content") or "" for d in deltas), "no answer text was streamed"


@pytest.mark.slow
def test_declared_oversized_body_is_refused_before_it_is_sent(server):
    """Content-Length over the limit: 413 at once, without waiting for (or buffering) the body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT_S) as sock:
        sock.sendall(f"POST {CMPL} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {MAX_BODY + 1}\r\nX-Request-Id: early-413\r\n\r\n".encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(4096)
            assert chunk, f"connection closed before a response: {reply!r}"
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert b"x-request-id: early-413" in reply.lower()


def test_server_limits_refuse_non_positive_values():
    with pytest.raises(ValueError, match="--max-n must be a positive integer"):
        ServerLimits(max_n=0)
    with pytest.raises(ValueError, match="--max-request-body-bytes"):
        ServerLimits(max_request_body_bytes=-1)


async def _read_body_then_fail(scope, receive, send) -> None:
    """A bare ASGI app: reads the whole body, then fails, as a route with a bug would."""
    while (await receive()).get("more_body"):
        pass
    raise RuntimeError("boom")


def test_middlewares_answer_for_any_app_in_openai_shape():
    """Without FastAPI's handlers: the body limit still answers 413, and an unexpected exception is
    a 500 in OpenAI's shape carrying the request id, not Starlette's plain-text one."""
    app = RequestIdMiddleware(BodySizeLimitMiddleware(_read_body_then_fail, max_body_bytes=8))
    client = TestClient(app, raise_server_exceptions=False)
    too_big = client.post("/", content=iter([b"12345", b"67890"]), headers={"X-Request-Id": "r-413"})
    assert too_big.status_code == 413 and too_big.headers["X-Request-Id"] == "r-413"
    assert too_big.json()["error"]["message"].endswith("(request id: r-413)")
    failed = client.post("/", content=b"1234")
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "InternalServerError"
    assert "RuntimeError: boom" in failed.json()["error"]["message"]
    assert failed.json()["error"]["message"].endswith(f"(request id: {failed.headers['X-Request-Id']})")


LINES = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
NOT_SYSTEM = "{% for m in messages if m['role'] != 'system' %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
SYSTEM_FIRST_ONLY = "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}" + NOT_SYSTEM
"""Renders a system prompt only as the first message, as many templates do: a later one is dropped."""
SYSTEM_MOVED_FIRST = "{% for m in messages if m['role'] == 'system' %}{{ m['content'] }}\n{% endfor %}" + NOT_SYSTEM
"""Gathers every system message at the start: a later one is moved before the messages it followed."""
SHOUTED = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
"""Changes every message's text: where the messages went cannot be told, so nothing is refused."""
DOCUMENTS = ("{% for d in documents or [] %}{{ d['title'] + ': ' + d['text'] }}\n{% endfor %}"
             "{% for m in messages %}{{ m['name'] + ': ' if m['name'] is defined }}{{ m['content'] }}\n{% endfor %}")
"""Uses a template variable (documents) and an extra message field (name) as many templates do."""


def serving_with(template: str) -> OpenAIServing:
    """The chat-rendering part of a server whose chat template is `template` (no engine behind it)."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    engine = SimpleNamespace(tokenizer=Tokenizer(backend), stat_loggers=[], processor=SimpleNamespace(images=None),
                             config=SimpleNamespace(structured_outputs=SimpleNamespace(reasoning_parser=None),
                                                    model=SimpleNamespace(multimodal=MultiModalConfig.parse(
                                                        None, None, None))))
    return OpenAIServing(engine, models=None, chat_template=template)


@pytest.mark.parametrize(("template", "placed"), [(LINES, True), (SHOUTED, True), (SYSTEM_FIRST_ONLY, False),
                                                  (SYSTEM_MOVED_FIRST, False)])
def test_a_late_system_message_is_refused_where_the_template_drops_or_moves_it(template, placed):
    serving = serving_with(template)
    system_first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert "be brief." in serving.chat_text(ChatPromptFields(messages=system_first)).lower()
    late = ChatPromptFields(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                                      {"role": "system", "content": "Answer in French."}])
    if placed:
        text = serving.chat_text(late).lower()
        assert text.index("hello!") < text.index("answer in french.")
        return
    with pytest.raises(APIError) as refused:
        serving.chat_text(late)
    assert refused.value.param == "messages" and "messages[2] (system)" in refused.value.message


@pytest.mark.parametrize(("fields", "param"), [
    ({"chat_template_kwargs": {"documents": 5}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"documents": [{"title": 1, "text": "x"}]}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "hi", "name": 1}], "chat_template_kwargs": {"documents": []}},
     "messages"),
])
def test_a_template_failing_on_a_value_is_a_400_naming_the_field_that_holds_it(fields, param):
    serving = serving_with(DOCUMENTS)
    docs = ChatPromptFields(messages=HI, chat_template_kwargs={"documents": [{"title": "A", "text": "b"}]})
    assert serving.chat_text(docs).startswith("A: b\n")
    with pytest.raises(APIError) as refused:
        serving.chat_text(ChatPromptFields(**{"messages": HI, **fields}))
    assert refused.value.param == param and "TypeError" not in refused.value.message, refused.value.message
