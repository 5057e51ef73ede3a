"""Security checks of `pagellm serve`:

* chat templates run in jinja2's immutable sandbox: a template cannot reach Python internals, load
  another template (no file is read) or call `open`; a request cannot send a template of its own, and
  what it sends through `chat_template_kwargs` or message fields reaches the template as data only;
* no request field makes the server read a file or fetch a URL: content parts that carry one (images,
  files, audio) are refused, a JSON schema `$ref` outside the schema is refused (xgrammar would have
  read it as "any value"), a model name is only a name;
* the admin routes (LoRA adapter load and unload: the only routes that change the server's state) are
  off by default and under the API key when on (their refusals are in test_catalogue.py; their absence
  by default in tests/test_lora_server.py); a caller with the key may make the server read
  `adapter_config.json` and the adapter's weights (safetensors, or a `.bin` through torch's
  `weights_only` loader, which runs no pickled code) from any folder the server process can read, and
  learn from the error whether a folder exists;
* CORS is closed: no Access-Control-Allow-Origin header, on a preflight or any other request;
* the API key is never logged, given by the flag or the environment, right or wrong, at uvicorn's most
  verbose log level (tests/test_server_reliability.py checks the info level)."""
from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from server_utils import RemoteServer

from adversarial.probes import AUTH, CHAT_TEMPLATE, ENGINE_FLAGS, HI, MODEL, assert_serves_normally, server_faults
from pagellm.config import StructuredOutputsConfig
from pagellm.entrypoints.openai.server_start import load_chat_template
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.errors import GrammarError
from pagellm.structured_output.source import GrammarChecker
from pagellm.tokenizer.chat_template import compile_chat_template, render_chat_template

TIMEOUT_S = 60.0
SANDBOX_ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{{ ''|attr('__class__')|attr('__mro__') }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ self._TemplateReference__context }}",
    "{{ self.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ 'a'.format.__globals__ }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ ''.join.__self__.__class__ }}",
    "{{ messages.append({}) }}{{ messages }}",
    "{{ open('/etc/passwd').read() }}",
    "{{ config }}{{ request }}{{ settings }}",
]
"""Templates that try to reach Python internals, the file system or the values passed in."""
TEMPLATE_LOADING = ["{% include '/etc/passwd' %}", "{% import '/etc/passwd' as p %}{{ p }}",
                    "{% extends '/etc/passwd' %}", "{% from '/etc/passwd' import x %}{{ x }}",
                    "{% include name %}"]
LEAKS = ("<class", "<function", "<module", "<built-in", "<bound", "object at 0x", "<Context", "root:", "uid=")
"""What a rendered text would hold had it reached Python objects, /etc/passwd or a shell."""


def render(template: str, **kwargs) -> str:
    return render_chat_template(template, [{"role": "user", "content": "hi"}], True, {}, **kwargs)


@pytest.mark.parametrize("template", SANDBOX_ESCAPES)
def test_a_template_cannot_reach_python_internals_or_files(template):
    try:
        text = render(template)
    except ValueError as e:  # the sandbox's SecurityError, or an undefined name, as the renderer reports it
        assert "unsafe" in str(e) or "is undefined" in str(e), e
        return
    assert not any(leak in text for leak in LEAKS), text
    assert text.strip(" {}[],") in ("", "hi", "user"), f"rendered {text!r}"


@pytest.mark.parametrize("template", TEMPLATE_LOADING)
def test_a_template_cannot_load_another_template(template):
    with pytest.raises(ValueError, match="`include`, `import`, `extends` and `from` are not allowed"):
        compile_chat_template(template)
    with pytest.raises(ValueError, match="^--chat-template: chat template loads another template"):
        load_chat_template(template)


def test_request_values_reach_the_template_as_data():
    for value in SANDBOX_ESCAPES + TEMPLATE_LOADING:
        assert value in render(CHAT_TEMPLATE, note=value), value
    # A key of a value sent is data too: its item is that value's, not an attribute of the dict.
    assert render("{{ note.__class__ }}|{{ note['__class__'] }}", note={"__class__": "x"}) == "|x"


@pytest.mark.parametrize("ref", ["file:///etc/passwd", "/etc/passwd", "other.json#/a", "http://127.0.0.1:9/s",
                                 "https://example.com/schema.json"])
def test_a_json_schema_may_refer_only_within_itself(ref):
    checker = GrammarChecker(StructuredOutputsConfig())
    for schema in ({"$ref": ref}, {"type": "object", "properties": {"a": {"$ref": ref}}},
                   {"anyOf": [{"type": "string"}, {"items": {"$ref": ref}}]}):
        with pytest.raises(GrammarError, match="only references within the schema .* nothing is fetched"):
            checker.check(StructuredOutputsParams(json=schema))
    local = {"$defs": {"a": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
             "required": ["a"], "const": {"$ref": ref}}  # a const is a value: its "$ref" key is data
    checker.check(StructuredOutputsParams(json=local))


# -- a live server ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_chat_template_kwargs_reach_the_template_as_data_and_never_fail_the_server(adversary):
    """Through the server: each escape sent as a template variable comes back as text (/tokenize, then
    /detokenize), and variables that shadow the template's globals or break its `range` are 400s."""
    with httpx.Client(base_url=adversary.url, headers=AUTH, timeout=TIMEOUT_S) as http:
        for value in SANDBOX_ESCAPES + TEMPLATE_LOADING:
            tokens = http.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {"note": value}})
            assert tokens.status_code == 200, tokens.text
            text = http.post("/detokenize", json={"tokens": tokens.json()["tokens"]}).json()["prompt"]
            assert value in text and not any(leak in text.replace(value, "") for leak in LEAKS), text
        statuses = {}
        for name in ("cycler", "joiner", "namespace", "lipsum", "range", "dict", "raise_exception", "strftime_now",
                     "self", "loop", "caller", "varargs", "kwargs", "__builtins__", "__class__"):
            for value in (1, "x", {"__globals__": 1}, None):
                kwargs = {name: value, "repeat": 2}
                response = http.post("/tokenize", json={"messages": HI, "chat_template_kwargs": kwargs})
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                assert response.status_code in (200, 400), (kwargs, response.text)
                assert not any(leak in response.text for leak in LEAKS), (kwargs, response.text)
        assert statuses[400] and statuses[200], statuses
        for repeat in (10 ** 6, 2 ** 63, -1, 1.5, "many"):
            response = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1,
                                                               "chat_template_kwargs": {"repeat": repeat}})
            expected = 200 if repeat == -1 else 400
            assert response.status_code == expected, (repeat, response.text)
            if expected == 400:
                assert response.json()["error"]["param"] == "chat_template_kwargs"
    assert_serves_normally(adversary, AUTH)
    assert not server_faults(adversary.log_tail(1_000_000))


@pytest.fixture
def listener() -> Iterator[tuple[str, list[bytes]]]:
    """A TCP listener on the loopback: (its http:// address, the requests it received). The server must
    never connect to it."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.1)
    received: list[bytes] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = sock.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(1.0)
                try:
                    received.append(connection.recv(4096) or b"<connected>")
                except TimeoutError:
                    received.append(b"<connected>")

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", received
    finally:
        stop.set()
        thread.join()
        sock.close()


def fetching_requests(file_url: str, path: str, url: str) -> list[tuple[str, dict]]:
    """(route, body) of every request field that could name a file or a URL, pointing at `path` (its
    `file_url`) or at `url`."""
    def schema(ref: str) -> dict:
        return {"type": "object", "properties": {"a": {"$ref": ref}}, "required": ["a"]}

    def user(*parts: dict) -> list[dict]:
        return [{"role": "user", "content": list(parts)}]

    requests = []
    for target in (file_url, path, url):
        requests += [
            ("/v1/chat/completions", {"messages": user({"type": "image_url", "image_url": {"url": target}})}),
            ("/v1/chat/completions", {"messages": user({"type": "file", "file": {"file_id": target}})}),
            ("/v1/chat/completions", {"messages": user({"type": "input_audio",
                                                         "input_audio": {"data": target, "format": "wav"}})}),
            ("/v1/chat/completions", {"messages": HI, "max_tokens": 2, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": schema(target)}}}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": schema(target)}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": schema(target)}}),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "model": target}),
            ("/v1/responses", {"input": user({"type": "input_image", "image_url": target})}),
            ("/v1/responses", {"input": user({"type": "input_file", "file_url": target})}),
            ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                                 "schema": schema(target)}}}),
            ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": user(
                {"type": "image", "source": {"type": "url", "url": target}})}),
            ("/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": user(
                {"type": "document", "source": {"type": "url", "url": target}})}),
            ("/tokenize", {"messages": user({"type": "image_url", "image_url": {"url": target}})}),
            ("/tokenize", {"prompt": "hi", "model": target}),
        ]
    return requests


@pytest.mark.slow
def test_no_request_field_reads_a_file_or_fetches_a_url(adversary, listener, tmp_path):
    secret = "canary-" + os.urandom(8).hex()
    canary = tmp_path / "canary.txt"
    canary.write_text(secret)
    url, received = listener
    requests = fetching_requests(canary.as_uri(), str(canary), f"{url}/canary.json")
    with httpx.Client(base_url=adversary.url, headers=AUTH, timeout=TIMEOUT_S) as http:
        for path, body in requests:
            response = http.post(path, json=body)
            assert 400 <= response.status_code < 500, (path, body, response.text)
            assert secret not in response.text
        for path in (f"/v1/models/{canary}", f"/v1/models/{canary.as_uri()}"):
            assert http.get(path).status_code == 404
    assert received == [], f"the server connected to {url}: {received}"
    assert_serves_normally(adversary, AUTH)


STATE_CHANGING = ("post", "put", "patch", "delete")
GENERATION_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                     "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize"}
"""The POST routes that only compute an answer: they change no state of the server's."""
ADMIN_ROUTES = {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
"""The routes that change what the server serves."""


def routes_by_method(server: RemoteServer, headers: dict[str, str] | None = None) -> set[str]:
    """Every route of the server's OpenAPI schema that takes a method other than GET."""
    schema = httpx.get(f"{server.url}/openapi.json", headers=headers, timeout=TIMEOUT_S).json()
    return {path for path, operations in schema["paths"].items() if set(operations) & set(STATE_CHANGING)}


@pytest.mark.slow
def test_the_admin_routes_are_off_by_default_and_under_the_key(smollm2_server, adversary):
    """The inventory: a new route that changes state fails this test until it is added (and guarded)."""
    assert routes_by_method(smollm2_server) == GENERATION_ROUTES
    assert routes_by_method(adversary, AUTH) == GENERATION_ROUTES | ADMIN_ROUTES
    for path in ADMIN_ROUTES:
        assert httpx.post(f"{smollm2_server.url}{path}", json={"lora_name": "x", "lora_path": "/"},
                          timeout=TIMEOUT_S).status_code == 404
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}):
            refused = httpx.post(f"{adversary.url}{path}", json={"lora_name": "x", "lora_path": "/"}, headers=headers,
                                 timeout=TIMEOUT_S)
            assert refused.status_code == 401, (path, headers)
    assert httpx.get(f"{adversary.url}/openapi.json", timeout=TIMEOUT_S).status_code == 401


@pytest.mark.slow
def test_cors_is_closed(smollm2_server, adversary):
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    for server, headers in ((smollm2_server, {}), (adversary, AUTH)):
        for path in ("/v1/chat/completions", "/v1/models", "/tokenize", "/health"):
            response = httpx.options(f"{server.url}{path}", headers={**headers, **preflight}, timeout=TIMEOUT_S)
            assert 400 <= response.status_code < 500, (path, response.status_code)
            assert not any(name.lower().startswith("access-control-") for name in response.headers), path
        plain = httpx.get(f"{server.url}/v1/models", headers={**headers, "Origin": "https://evil.example"},
                          timeout=TIMEOUT_S)
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


@pytest.mark.slow
def test_the_api_key_is_never_logged(smollm2_path):
    """Given on the command line (visible to `ps`, but never written to the log), with uvicorn's trace
    log of every ASGI message: right and wrong keys in either header, a wrong key never echoed."""
    key, wrong = "key-" + os.urandom(12).hex(), "wrong-" + os.urandom(12).hex()
    server = RemoteServer(smollm2_path, *ENGINE_FLAGS, "--api-key", key, "--uvicorn-log-level", "trace")
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        message = {"model": MODEL, "messages": HI, "max_tokens": 2}
        with httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
            for headers in ({"Authorization": f"Bearer {key}"}, {"x-api-key": key}):
                assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
                assert http.post("/v1/messages", json=message, headers=headers).status_code == 200
            for headers in ({"Authorization": f"Bearer {wrong}"}, {"x-api-key": wrong}, {"Authorization": wrong},
                            {"Authorization": f"Basic {wrong}"}, {"Authorization": f"Bearer {key}{wrong}"}):
                for path in ("/v1/completions", "/v1/messages", "/v1/models", "/metrics?x=1"):
                    refused = http.post(path, json=body, headers=headers)
                    assert refused.status_code in (401, 405) and wrong not in refused.text, (path, refused.text)
            stream = {**body, "stream": True}
            with http.stream("POST", "/v1/completions", json=stream, headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status_code == 200 and json.loads(next(r.iter_lines()).removeprefix("data: "))["choices"]
        log = server.log_tail(10_000_000)
        assert "ASGI [" in log, "uvicorn's trace log is on"
        assert key not in log and wrong not in log
    finally:
        assert server.stop() == 0
