"""Bad requests on every route of an exposed server (API key, admin routes on), beyond
tests/test_validation_catalogue.py's (chat and completions fields, bodies, limits): the Responses,
Messages, embeddings, tokenizer, model, probe, metrics and LoRA admin routes, wrong methods, missing and
wrong keys, and requests that reach the chat template or the grammar compiler with values meant to break
them. Each gets its 4xx in the route's error shape (Anthropic's on /v1/messages*) naming what to fix, never
a 5xx, and the server then serves normally with nothing left in flight."""
from __future__ import annotations

import pytest
from catalogue_utils import Case, mismatch, send

from adversarial.probes import AUTH, HI, MODEL, assert_serves_normally, server_faults

pytestmark = pytest.mark.slow  # the shared adversary server (conftest.py)

CMPL, CHAT, RESP, MSGS, COUNT = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", \
    "/v1/messages/count_tokens"
EMBED, TOKENIZE, DETOKENIZE = "/v1/embeddings", "/tokenize", "/detokenize"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
NO_KEY = {"Authorization": ""}
WRONG_KEY = {"Authorization": "Bearer not-the-key"}


def chat(**fields) -> dict:
    return {"messages": HI, "max_tokens": 2, **fields}


def message(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


def part(kind: str, **fields) -> list[dict]:
    """One user message holding one content part of `kind`."""
    return [{"role": "user", "content": [{"type": kind, **fields}]}]


def external_ref(ref: str) -> dict:
    return {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}


CATALOGUE = [
    # Chat and completions: values the first catalogue does not try.
    Case("message not an object", CHAT, {"messages": ["hi"]}, 400, "valid dictionary", "messages.0"),
    Case("text part without text", CHAT, {"messages": part("text")}, 400,
         "content.list[tagged-union[TextPart,ImagePart]].0.text.text: Field required", "messages.0.content.str"),
    Case("input_audio part", CHAT, {"messages": part("input_audio", input_audio={"data": "x", "format": "wav"})},
         400, "only text and image_url content parts", "messages.0.content.0"),
    Case("file part", CHAT, {"messages": part("file", file={"file_data": "x"})}, 400,
         "only text and image_url content parts", "messages.0.content.0"),
    Case("chat_template in the request", CHAT, chat(chat_template="{{ 1 }}"), 400, "Extra inputs are not permitted",
         "chat_template"),
    Case("chat_template_kwargs not an object", CHAT, chat(chat_template_kwargs="x"), 400, "valid dictionary",
         "chat_template_kwargs"),
    Case("chat_template_kwargs past the sandbox's range", CHAT, chat(chat_template_kwargs={"repeat": 10 ** 6}), 400,
         "range", "chat_template_kwargs"),
    Case("chat_template_kwargs past a C integer", CHAT, chat(chat_template_kwargs={"repeat": 2 ** 63}), 400,
         "a value it cannot use", "chat_template_kwargs"),
    Case("chat_template_kwargs shadowing range", CHAT, chat(chat_template_kwargs={"range": 1}), 400,
         "not callable", "chat_template_kwargs"),
    Case("n beyond 64 bits", CHAT, chat(n=2 ** 64), 400, "less than or equal to", "n"),
    Case("max_tokens beyond 64 bits", CMPL, {"prompt": "hi", "max_tokens": 2 ** 64}, 400, "less than or equal to",
         "max_tokens"),
    Case("logit_bias value as a string", CMPL, {"prompt": "hi", "logit_bias": {"5": "1"}}, 400, "valid number",
         "logit_bias.5"),
    Case("prompt of mixed types", CMPL, {"prompt": ["a", 1]}, 400, "prompt", "prompt.str"),
    Case("prompt of floats", CMPL, {"prompt": [1.5]}, 400, "prompt", "prompt.str"),
    Case("JSON schema $ref to a file", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": external_ref("file:///etc/passwd")}}), 400, "only references within the schema",
         "response_format.json_schema.schema"),
    Case("guided_json $ref to a URL", CMPL, {"prompt": "hi", "guided_json": external_ref("http://127.0.0.1:9/s")}, 400,
         "nothing is fetched", "guided_json"),
    Case("JSON null body", CMPL, b"null", 400, "valid dictionary"),
    Case("empty body", CHAT, b"", 400, "body: Field required"),
    Case("gzip-encoded body", CMPL, b"\x1f\x8b\x08\x00garbage", 400, "not valid UTF-8",
         headers={"content-encoding": "gzip"}),
    Case("completions by GET", CMPL, None, 405, "Method Not Allowed", method="GET"),
    # The Responses API.
    Case("responses input a number", RESP, {"input": 5}, 400, "input", "input"),
    Case("responses function_call item", RESP, {"input": [
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, 400, "only message items",
         "input.0.type"),
    Case("responses input_image part", RESP, {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "file:///etc/passwd"}]}]}, 400, "this model takes text only", "input"),
    Case("responses tools", RESP, {"input": "hi", "tools": [{"type": "function", "name": "f"}]}, 400, "tools",
         "tools"),
    Case("responses background", RESP, {"input": "hi", "background": True}, 400, "background", "background"),
    Case("responses top_logprobs", RESP, {"input": "hi", "top_logprobs": 3}, 400, "top_logprobs", "top_logprobs"),
    Case("responses tool role", RESP, {"input": [{"role": "tool", "content": "x"}]}, 400, "0.role: Input should be",
         "input.str"),
    Case("responses unknown previous_response_id", RESP, {"input": "hi", "previous_response_id": "resp_nope"}, 404,
         "resp_nope", "previous_response_id"),
    Case("responses text format type", RESP, {"input": "hi", "text": {"format": {"type": "xml"}}}, 400, "'json_schema'",
         "text.format.type"),
    Case("responses instructions a number", RESP, {"input": "hi", "instructions": 5}, 400, "valid string",
         "instructions"),
    Case("responses chat_template", RESP, {"input": "hi", "chat_template": "{{ 1 }}"}, 400,
         "Extra inputs are not permitted", "chat_template"),
    # Anthropic's Messages API: Anthropic's error shape.
    Case("messages without max_tokens", MSGS, {"model": MODEL, "messages": HI}, 400, "max_tokens: Field required"),
    Case("messages max_tokens as a string", MSGS, message(max_tokens="2"), 400, "valid integer"),
    Case("messages temperature over 1", MSGS, message(temperature=1.5), 400, "less than or equal to 1"),
    Case("messages image block", MSGS, {**message(), "messages": part("image", source={
        "type": "url", "url": "file:///etc/passwd"})}, 400, "Input should be 'text'"),
    Case("messages tool_use block", MSGS, {**message(), "messages": part("tool_use", id="t", name="f", input={})},
         400, "Input should be 'text'"),
    Case("messages system role", MSGS, {**message(), "messages": [{"role": "system", "content": "x"}]}, 400,
         "'user' or 'assistant'"),
    Case("messages empty", MSGS, message(messages=[]), 400, "at least 1 item"),
    Case("messages stream as a string", MSGS, message(stream="yes"), 400, "valid boolean"),
    Case("messages unknown field", MSGS, message(temprature=0.5), 400, "Extra inputs are not permitted"),
    Case("messages unknown model", MSGS, message(model="claude-x"), 404, "`claude-x` does not exist"),
    Case("messages not JSON", MSGS, b"{not json", 400, "not valid JSON"),
    Case("messages stop_sequences a string", MSGS, message(stop_sequences="x"), 400, "valid list"),
    Case("messages chat_template", MSGS, message(chat_template="{{ 1 }}"), 400, "Extra inputs are not permitted"),
    Case("messages without the key", MSGS, message(), 401, "missing or wrong API key", headers=NO_KEY),
    Case("messages by GET", MSGS, None, 405, "Method Not Allowed", method="GET"),
    Case("count_tokens without model", COUNT, {"messages": HI}, 400, "model: Field required"),
    Case("count_tokens system a number", COUNT, {"model": MODEL, "messages": HI, "system": 5}, 400, "system"),
    # Embeddings (validated before the runner is: this server generates).
    Case("embeddings without input", EMBED, {"model": MODEL}, 400, "Field required", "input"),
    Case("embeddings input a number", EMBED, {"input": 5}, 400, "input", "input.str"),
    Case("embeddings encoding_format", EMBED, {"input": "hi", "encoding_format": "hex"}, 400, "'float' or 'base64'",
         "encoding_format"),
    Case("embeddings dimensions as a string", EMBED, {"input": "hi", "dimensions": "8"}, 400, "valid integer",
         "dimensions"),
    Case("embeddings on a generating server", EMBED, {"input": "hi"}, 400, "--runner pooling"),
    # The tokenizer routes.
    Case("tokenize image part", TOKENIZE, {"messages": part("image_url", image_url={"url": "file:///etc/passwd"})},
         400, "image parts are taken by chat completions only", "messages"),
    Case("tokenize chat_template", TOKENIZE, {"messages": HI, "chat_template": "{{ 1 }}"}, 400,
         "Extra inputs are not permitted", "chat.chat_template"),
    Case("tokenize chat_template_kwargs past the sandbox's range", TOKENIZE,
         {"messages": HI, "chat_template_kwargs": {"repeat": 10 ** 6}}, 400, "range", "chat_template_kwargs"),
    Case("tokenize unknown field", TOKENIZE, {"prompt": "hi", "truncate": 3}, 400, "Extra inputs",
         "completion.truncate"),
    Case("detokenize without tokens", DETOKENIZE, {}, 400, "Field required", "tokens"),
    Case("detokenize tokens a string", DETOKENIZE, {"tokens": "1 2"}, 400, "valid list", "tokens"),
    Case("detokenize nested list", DETOKENIZE, {"tokens": [[1]]}, 400, "valid integer", "tokens.0"),
    Case("detokenize float id", DETOKENIZE, {"tokens": [1.5]}, 400, "valid integer", "tokens.0"),
    Case("tokenize without the key", TOKENIZE, {"prompt": "hi"}, 401, "missing or wrong API key", headers=NO_KEY),
    Case("tokenizer_info by POST", "/tokenizer_info", {}, 405, "Method Not Allowed"),
    # Models, probes, metrics.
    Case("models with a wrong key", "/v1/models", None, 401, "missing or wrong API key", method="GET",
         headers=WRONG_KEY),
    Case("model deleted", f"/v1/models/{MODEL}", None, 405, "Method Not Allowed", method="DELETE"),
    Case("model by POST", f"/v1/models/{MODEL}", {}, 405, "Method Not Allowed"),
    Case("model path traversal", "/v1/models/..%2F..%2Fetc%2Fpasswd", None, 404, "does not exist", "model",
         method="GET"),
    Case("health by POST", "/health", None, 405, "Method Not Allowed"),
    Case("readiness by PUT", "/health/ready", None, 405, "Method Not Allowed", method="PUT"),
    Case("liveness by DELETE", "/health/live", None, 405, "Method Not Allowed", method="DELETE"),
    Case("metrics by POST", "/metrics", None, 405, "Method Not Allowed"),
    Case("version by PATCH", "/version", None, 405, "Method Not Allowed", method="PATCH"),
    # The LoRA admin routes (--allow-runtime-lora-updating).
    Case("load without lora_path", LOAD, {"lora_name": "x"}, 400, "Field required", "lora_path"),
    Case("load lora_path a number", LOAD, {"lora_name": "x", "lora_path": 5}, 400, "valid string", "lora_path"),
    Case("load unknown field", LOAD, {"lora_name": "x", "lora_path": "/tmp", "base_model": "y"}, 400,
         "Extra inputs", "base_model"),
    Case("load a file", LOAD, {"lora_name": "x", "lora_path": "/etc/passwd"}, 400, "is not a folder"),
    Case("load a folder of no adapter", LOAD, {"lora_name": "x", "lora_path": "/etc"}, 400,
         "no adapter_config.json in '/etc'"),
    Case("load a missing folder", LOAD, {"lora_name": "x", "lora_path": "/no/such/adapter"}, 400,
         "the folder does not exist"),
    Case("load under the base model's name", LOAD, {"lora_name": MODEL, "lora_path": "/etc"}, 400,
         "the base model's name"),
    Case("load with an empty name", LOAD, {"lora_name": "", "lora_path": "/etc"}, 400, "non-empty string"),
    Case("load without the key", LOAD, {"lora_name": "x", "lora_path": "/etc"}, 401, "missing or wrong API key",
         headers=NO_KEY),
    Case("unload an unknown adapter", UNLOAD, {"lora_name": "nope"}, 404, "no LoRA adapter `nope`", "lora_name"),
    Case("unload without lora_name", UNLOAD, {}, 400, "Field required", "lora_name"),
    Case("unload with a wrong key", UNLOAD, {"lora_name": "nope"}, 401, "missing or wrong API key",
         headers=WRONG_KEY),
    Case("load by GET", LOAD, None, 405, "Method Not Allowed", method="GET"),
]


def test_catalogue_of_bad_requests_on_every_route_gets_4xx_and_harms_nothing(adversary):
    assert len(CATALOGUE) >= 60 and len({c.name for c in CATALOGUE}) == len(CATALOGUE)
    failures = {}
    for i, case in enumerate(CATALOGUE):
        request_id = f"adversarial-{i}"
        problem = mismatch(case, send(adversary.url, case, request_id, AUTH), request_id)
        if problem is not None:
            failures[case.name] = problem
    assert not failures, "\n".join(f"{name}: {problem}" for name, problem in failures.items())
    assert_serves_normally(adversary, AUTH)
    assert not server_faults(adversary.log_tail(1_000_000))
