"""What the adversarial tests share: the servers' flags, the checks that a server is serving normally and
holds nothing (no request running or waiting, no KV block, nothing admitted), one request sent and its
outcome classified, and the process tree of a server (for orphans)."""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass

import httpx
import psutil
from engine_utils import wait_for
from server_utils import RemoteServer, is_idle, metric_samples

MODEL = "smollm2"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 4
SEQS_IN_FLIGHT = 8
"""--max-seqs-in-flight: twice --max-num-seqs, as the default is."""
WAITING_REQUESTS = 8
QUEUE_TIMEOUT_S = 3.0
ENGINE_FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20),
                "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL)
ADMISSION_FLAGS = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-seqs-in-flight", str(SEQS_IN_FLIGHT),
                   "--max-waiting-requests", str(WAITING_REQUESTS), "--queue-timeout", f"{QUEUE_TIMEOUT_S:g}")
"""A small capacity, so that a few dozen clients overload it: 8 sequences admitted, 8 requests waiting
for room for at most 3 s."""
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating")
API_KEY = "adversary-" + os.urandom(8).hex()
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if note is defined %}{{ note }}{% endif %}"
                 "{% for _ in range(repeat | default(0)) %}.{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""SmolLM2's chat format, plus two template variables a request may set through chat_template_kwargs:
`note` (printed as it is) and `repeat` (a count for `range`)."""
HI = [{"role": "user", "content": "hi"}]
IDLE_TIMEOUT_S = 60.0
"""How long a server may take to settle after a run (every response is over by then)."""

ROUTES = {  # path -> a small valid body, streamed or not by its "stream" field
    "/v1/completions": {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8},
    "/v1/chat/completions": {"model": MODEL, "messages": HI, "max_tokens": 8},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 8},
    "/v1/messages": {"model": MODEL, "messages": HI, "max_tokens": 8},
}
"""The generation routes (each admitted by its work), as their own clients call them."""


def settled(samples: dict[str, float]) -> bool:
    """Nothing running, waiting or admitted, and no KV block held."""
    return (is_idle(samples) and samples["pagellm:admitted_sequences"] == 0
            and samples["pagellm:requests_waiting_for_admission"] == 0)


def wait_settled(server: RemoteServer, headers: dict[str, str] | None = None) -> dict[str, float]:
    """Poll /metrics until the server has settled (failing at IDLE_TIMEOUT_S); the last samples."""
    seen: list[dict[str, float]] = []
    try:
        asyncio.run(wait_for(lambda: seen.append(metric_samples(server.url, headers)) or settled(seen[-1]),
                             timeout_s=IDLE_TIMEOUT_S))
    except AssertionError:
        gauges = {k: v for k, v in seen[-1].items() if "running" in k or "waiting" in k or "admitted" in k
                  or "kv_cache_usage" in k}
        raise AssertionError(f"the server did not settle: {gauges}") from None
    return seen[-1]


def assert_serves_normally(server: RemoteServer, headers: dict[str, str] | None = None) -> None:
    """A normal request succeeds, /health says ok, and the server settles: nothing left in flight."""
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "The sky is", "max_tokens": 4,
                                                      "ignore_eos": True})
        assert response.status_code == 200, response.text[:300]
        assert response.json()["usage"]["completion_tokens"] == 4
        assert http.get("/health").json() == {"status": "ok"}
    wait_settled(server, headers)


def server_faults(log: str) -> list[str]:
    """The lines of a server log that show a fault of the server's own: a traceback, a 5xx answer, an
    exception nobody retrieved."""
    return [line for line in log.splitlines()
            if "Traceback" in line or "never retrieved" in line or " 500 " in line or "-> 500" in line]


# -- one request and what came of it ---------------------------------------------------------------------

OK, ERROR, STREAM_ERROR, NOT_CONNECTED, CUT_OFF, BAD = "ok", "error", "stream_error", "not_connected", "cut_off", "bad"
DONE_PATHS = ("/v1/completions", "/v1/chat/completions")
"""Streams that end with `data: [DONE]`; the others end with a named event."""
ANTHROPIC_STATUSES = {"overloaded_error": 503, "timeout_error": 504, "api_error": 500}
"""The status an Anthropic error event stands for, by its type."""
LAST_EVENTS = {"/v1/responses": ("response.completed", "response.incomplete"), "/v1/messages": ("message_stop",)}


@dataclass(frozen=True)
class Outcome:
    kind: str
    """OK (a complete answer), ERROR (an error body in the route's shape, `code` its status), STREAM_ERROR (a
    stream that ended with an error event of status `code`), NOT_CONNECTED (the server no longer listens),
    CUT_OFF (the connection broke mid-answer) or BAD (anything else: a malformed or unfinished answer)."""
    elapsed_s: float
    status: int | None = None
    code: int | None = None
    """The error's HTTP status (the response's, or the one an error event names)."""
    retry_after: str | None = None
    detail: str = ""
    """The error's message; what went wrong for CUT_OFF, NOT_CONNECTED and BAD."""


async def request_outcome(http: httpx.AsyncClient, path: str, body: dict) -> Outcome:
    """Send `body` to `path` (streamed if it says so) and classify the answer."""
    start = time.monotonic()
    try:
        async with http.stream("POST", path, json=body) as response:
            status, retry_after = response.status_code, response.headers.get("Retry-After")
            text = (await response.aread()).decode(errors="replace")
    except httpx.ConnectError as e:
        return Outcome(NOT_CONNECTED, time.monotonic() - start, detail=repr(e))
    except httpx.TransportError as e:
        return Outcome(CUT_OFF, time.monotonic() - start, detail=repr(e))
    elapsed = time.monotonic() - start
    if status == 200 and body.get("stream"):
        kind, error = _stream_end(text, path)
    else:
        kind, error = _plain_answer(status, text, path)
    if kind == BAD:
        return Outcome(BAD, elapsed, status, retry_after=retry_after, detail=text[-400:])
    code, message = _status_and_message(error, path, status if kind == ERROR else None)
    return Outcome(kind, elapsed, status, code, retry_after, message)


def _plain_answer(status: int, text: str, path: str) -> tuple[str, dict | None]:
    """(OK or ERROR or BAD, the error body)."""
    try:
        body = json.loads(text)
    except ValueError:
        return BAD, None
    if status == 200:
        return OK, None
    return (ERROR, body) if _is_error(body, path) else (BAD, None)


def _stream_end(text: str, path: str) -> tuple[str, dict | None]:
    """(OK or STREAM_ERROR or BAD, the error event's body): a stream ends with `data: [DONE]` after its last
    chunk, or with the named event that ends the route's stream; an error event last is a STREAM_ERROR."""
    events = [event for event in text.strip().split("\n\n") if event.strip()]
    data = [next((line[len("data: "):] for line in event.splitlines() if line.startswith("data: ")), "")
            for event in events]
    if path in DONE_PATHS:
        if not events or data[-1] != "[DONE]":
            return BAD, None
        last = data[-2] if len(data) > 1 else ""
    else:
        names = [next((line[len("event: "):] for line in event.splitlines() if line.startswith("event: ")), "")
                 for event in events]
        if names and names[-1] in LAST_EVENTS[path]:
            return OK, None
        if not names or names[-1] != "error":
            return BAD, None
        last = data[-1]
    try:
        body = json.loads(last) if last else {}
    except ValueError:
        return BAD, None
    if not isinstance(body, dict) or "error" not in body:
        return OK, None  # the last chunk of a complete stream
    return (STREAM_ERROR, body) if _is_error(body, path) else (BAD, None)


def _is_error(body: object, path: str) -> bool:
    """Whether `body` is an error in the route's shape (Anthropic's on /v1/messages, OpenAI's elsewhere)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return False
    if path == "/v1/messages":
        return body.get("type") == "error" and isinstance(error.get("type"), str)
    return isinstance(error.get("code"), int)


def _status_and_message(body: dict | None, path: str, status: int | None) -> tuple[int | None, str]:
    """The status an error stands for (the response's, or the one its error event names) and its message."""
    if body is None:
        return None, ""
    error = body["error"]
    if path == "/v1/messages":  # Anthropic's shape names a type, not a status
        return status or ANTHROPIC_STATUSES.get(error["type"]), error["message"]
    return error["code"], error["message"]


# -- processes ------------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and all its descendants (the engine core, multiprocessing's resource tracker)."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def survivors(processes: list[psutil.Process], timeout_s: float = 10.0) -> list[str]:
    """Those of `processes` still running after `timeout_s` (the same process: pid and start time), as
    'pid name status'."""
    gone, alive = psutil.wait_procs(processes, timeout=timeout_s)
    return [f"{p.pid} {p.name()} {p.status()}" for p in alive if p.is_running()]
