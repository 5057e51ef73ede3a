"""Schema fuzzing: schemathesis generates valid and invalid requests from the server's own OpenAPI
schema and sends them to a live server on the loopback. No response may be a 5xx, whatever the schema
rejects must get a 4xx, and afterwards the server is healthy and holds no KV blocks."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import httpx
import pytest

from engine_utils import wait_for
from server_utils import RemoteServer, is_idle, metric_samples

pytestmark = pytest.mark.slow  # a `pagellm serve` of the real model

MODEL = "smollm2"
# A short context and few sequences keep the requests that do generate cheap on a CPU.
FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "40",
         "--served-model-name", MODEL, "--max-n", "2", "--max-logprobs", "2", "--max-request-body-bytes", str(256 << 10))
MAX_EXAMPLES = 10
"""Generated cases per operation: bounds the run, whose time the few valid chat requests dominate (each
generates up to 8 tokens; with 20 per operation the run took 132 s on 2 cores shared at load ~8)."""
FUZZ_TIMEOUT_S = 300


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
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorResponse"}


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
