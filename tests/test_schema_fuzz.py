"""Schema fuzzing: schemathesis generates valid and invalid requests from the server's own OpenAPI
schema and sends them to a live server on the loopback. No response may be a 5xx, whatever the schema
rejects must get a 4xx, and afterwards the server is healthy and holds no KV blocks."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from typing import Any

import httpx
import jsonschema
import pytest

from engine_utils import wait_for
from server_utils import RemoteServer, is_idle, metric_samples

pytestmark = pytest.mark.slow  # a `pagellm serve` of the real model

MODEL = "smollm2"
# A short context and few sequences keep the requests that do generate cheap on a CPU.
FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "40",
         "--served-model-name", MODEL, "--max-n", "2", "--max-logprobs", "2",
         "--max-request-body-bytes", str(256 << 10))
MAX_EXAMPLES = 10
"""Generated cases per operation: bounds the run, whose time the few valid chat requests dominate (each
generates up to 8 tokens; with 20 per operation the run took 132 s on 2 cores shared at load ~8)."""
FUZZ_TIMEOUT_S = 300
HI = [{"role": "user", "content": "hi"}]
VALID_BODIES = {
    "CompletionRequest": ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    "ChatCompletionRequest": ("/v1/chat/completions", {"messages": HI, "max_tokens": 1}),
    "ResponsesRequest": ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
    "MessagesRequest": ("/v1/messages", {"model": MODEL, "messages": HI, "max_tokens": 1}),
    "CountTokensRequest": ("/v1/messages/count_tokens", {"model": MODEL, "messages": HI}),
    "EmbeddingRequest": ("/v1/embeddings", {"input": "hi"}),
    "TokenizeCompletionRequest": ("/tokenize", {"prompt": "hi"}),
    "TokenizeChatRequest": ("/tokenize", {"messages": HI}),
    "DetokenizeRequest": ("/detokenize", {"tokens": [1]}),
}
"""Each request model of the server's POST routes, with the route and a valid body of it."""
SCALARS = {"boolean", "integer", "number"}


@pytest.fixture(scope="module")
def server(smollm2_path):
    remote = RemoteServer(smollm2_path, *FLAGS)
    yield remote
    assert remote.stop() == 0, "the server did not shut down cleanly"


def test_openapi_schema_describes_the_request_bodies_and_errors(server):
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30.0).json()
    bodies = {path: ops["post"]["requestBody"]["content"]["application/json"]["schema"]
              for path, ops in schema["paths"].items() if "post" in ops}
    assert bodies["/v1/completions"] == {"$ref": "#/components/schemas/CompletionRequest"}
    assert bodies["/v1/chat/completions"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert {ref["$ref"] for ref in bodies["/tokenize"]["oneOf"]} == {
        "#/components/schemas/TokenizeCompletionRequest", "#/components/schemas/TokenizeChatRequest"}
    components = schema["components"]["schemas"]
    assert components["CompletionRequest"]["additionalProperties"] is False, "unknown fields are refused"
    assert components["ChatMessage"]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant",
                                                                       "tool"]
    seed = components["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed["maximum"] == pytest.approx(2 ** 63 - 1), "integers are bounded to what the engine can carry"
    for path in bodies:
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses, "FastAPI's 422 is never sent: invalid requests get a 400"
        shape = "AnthropicErrorResponse" if path.startswith("/v1/messages") else "ErrorResponse"
        assert responses["400"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{shape}"}


def test_schema_fuzzing_finds_no_server_error(server, tmp_path):
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
               "--checks", "not_a_server_error,negative_data_rejection", "--phases", "fuzzing",
               "--max-examples", str(MAX_EXAMPLES), "--seed", "1", "--workers", "1", "--request-timeout", "60",
               "--generation-database", "none", "--suppress-health-check", "all", "--no-color"]
    # cwd: a scratch folder, so nothing schemathesis or hypothesis writes lands in the repository.
    run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=FUZZ_TIMEOUT_S)
    report = run.stdout[-8000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"{report}\n--- server log ---\n{server.log_tail()}"
    generated = re.search(r"(\d+) generated", run.stdout)
    assert generated and int(generated.group(1)) >= 5 * MAX_EXAMPLES // 2, f"too few cases ran:\n{report}"
    assert httpx.get(f"{server.url}/health", timeout=30.0).status_code == 200
    asyncio.run(wait_for(lambda: is_idle(metric_samples(server.url))))


def _types(prop: dict) -> set[str]:
    return {branch["type"] for branch in prop.get("anyOf", [prop]) if "type" in branch}


def _as_string(prop: dict) -> Any:
    """A JSON string in place of the booleans or numbers (or the list of them) `prop` takes; None if
    it takes strings, or objects only."""
    types = _types(prop)
    if "string" in types:
        return None
    if types & SCALARS:
        return "1"
    items = [branch["items"] for branch in prop.get("anyOf", [prop]) if branch.get("type") == "array"]
    return ["1"] if items and not {"string"} & _types(items[0]) and _types(items[0]) & SCALARS else None


def _field_at_fault(response: httpx.Response) -> str:
    """The field a 400 names: its `param` in OpenAI's shape; in Anthropic's (no param), the start of
    its message, `field: what is wrong`."""
    error = response.json()["error"]
    return error["param"] or "" if "param" in error else error["message"].split(":", 1)[0]


def test_strings_are_never_booleans_or_numbers_on_any_route(server):
    """Every boolean, integer and number field (and list of them) of every request model, as the
    OpenAPI schema lists them, refuses a JSON string such as "1" with a 400 naming the field."""
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30.0).json()
    refs = {ref["$ref"].rsplit("/", 1)[1] for ops in schema["paths"].values() if "post" in ops
            for body in [ops["post"]["requestBody"]["content"]["application/json"]["schema"]]
            for ref in body.get("oneOf", [body])}
    assert refs == set(VALID_BODIES), "every request model has a valid body here"
    failures, checked = [], 0
    with httpx.Client(base_url=server.url, timeout=60.0) as http:
        for name, (path, valid) in VALID_BODIES.items():
            for field, prop in schema["components"]["schemas"][name]["properties"].items():
                value = _as_string(prop)
                if value is None:
                    continue
                checked += 1
                response = http.post(path, json={**valid, field: value})
                if response.status_code != 400 or field not in _field_at_fault(response).split("."):
                    failures.append(f"{name}.{field}={value!r}: {response.status_code} {response.text[:200]}")
    assert checked >= 60, f"only {checked} fields checked"
    assert not failures, "\n".join(failures)


def test_every_route_answers_a_400_in_the_shape_its_schema_documents(server):
    """/v1/messages documents (and answers) Anthropic's error shape, the other routes OpenAI's."""
    schema = httpx.get(f"{server.url}/openapi.json", timeout=30.0).json()
    for path, ops in schema["paths"].items():
        if "post" not in ops:
            continue
        response = httpx.post(f"{server.url}{path}", json=[1], timeout=30.0)
        documented = ops["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert response.status_code == 400, path
        jsonschema.validate(response.json(), {**documented, "components": schema["components"]})
        if path.startswith("/v1/messages"):
            body = response.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
            assert body["request_id"] == response.headers["X-Request-Id"], "as Anthropic's errors carry it"
