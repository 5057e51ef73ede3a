"""Soak test of `pagellm serve`: steady concurrency for a fixed time, then the server must be idle,
hold no KV block and have grown little in memory.

Loopback only, bounded in time and count. Starts `pagellm serve` on 127.0.0.1 (or drives one given by
`--url`) and keeps `--concurrency` clients busy for `--duration-s` seconds with a mix of requests:
completions, chat, Responses and Anthropic Messages, streamed and not, some with n > 1, logprobs or stop
strings, some invalid (each must get its own 4xx in the route's error shape), and `--num-aborts` streams
cut by the client at random points, spread evenly over the run. With more clients than the server admits
(`--max-seqs-in-flight` and `--max-waiting-requests` of the started server), some requests are turned
away: a 503 with `Retry-After` in the route's error shape is expected then (the client waits as long
before its next request, as the openai client does), any other 5xx is an error. The server's RSS
(API process plus engine core) is sampled throughout; growth is measured from the first samples after
`--warmup-s` to the last ones of the load. At the end it waits for the server to go idle and reads
/metrics: nothing running or waiting, no KV block held.

    .venv/bin/python -m benchmarks.soak                                      # 20 min, 1,000 cut streams
    .venv/bin/python -m benchmarks.soak --duration-s 150 --num-aborts 120 --warmup-s 30
    .venv/bin/python -m benchmarks.soak --url http://127.0.0.1:8000 --server-pid PID --num-blocks N
    .venv/bin/python -m benchmarks.soak --duration-s 600 --concurrency 24 --max-seqs-in-flight 8 \
        --max-waiting-requests 8 --queue-timeout 5                             # overloaded

Goals: no unexpected error (5xx, transport error, wrong status or malformed response), RSS growth
under 5%, no leaked KV block; the exit status is 0 only if all are met.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import psutil

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, summarize, write_json
from pagellm.loader import default_model_path
from tests.server_utils import RemoteServer, is_idle, metric_samples

SERVED_NAME = "soak"
MAX_RSS_GROWTH = 0.05
CLIENT_TIMEOUT_S = 300.0
"""Longest wait for one response: a request still unanswered after this is an error, not a hang."""
MAX_ERROR_SAMPLES = 50
LOG_CHARS = 50 << 20

TOPICS = ("the sun", "a river", "music", "a library", "rain", "a bridge", "a volcano", "a violin", "winter",
          "a desert", "a lighthouse", "chess", "a glacier", "bread", "a comet", "a forest", "a harbor", "thunder")
SHARED_CONTEXT = ("You are a patient teacher. Answer in plain words, give one example, and keep the answer "
                  "short enough to read aloud in under a minute. ") * 3
"""A long shared system prompt, so that chat requests hit the prefix cache."""

OK, CUT, FINISHED_BEFORE_CUT, REJECTED, TURNED_AWAY = (
    "ok", "cut", "finished_before_cut", "rejected_as_expected", "turned_away")
EXPECTED_OUTCOMES = (OK, CUT, FINISHED_BEFORE_CUT, REJECTED, TURNED_AWAY)
"""Every other outcome is an error: http_5xx, unexpected_status, transport_error, bad_response."""


@dataclass(slots=True)
class Spec:
    """One request to send and what its answer must look like."""

    kind: str
    path: str
    body: dict[str, Any] | bytes
    expect_status: int = 200
    cut_after: int | None = None
    """Stream: close the connection after this many events."""


@dataclass(slots=True)
class Result:
    outcome: str
    completion_tokens: int = 0
    detail: str = ""
    retry_after_s: float = 0.0
    """TURNED_AWAY: how long the server asked the client to wait."""


# -- what to send ----------------------------------------------------------------------------------------


def _chat_messages(rng: random.Random) -> list[dict[str, str]]:
    question = [{"role": "user", "content": f"In two sentences, what is {rng.choice(TOPICS)}?"}]
    return [{"role": "system", "content": SHARED_CONTEXT}, *question] if rng.random() < 0.5 else question


def _completion(rng: random.Random, model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "prompt": f"A short story about {rng.choice(TOPICS)}:",
            "max_tokens": rng.randint(8, 64), "temperature": rng.choice((0.0, 0.7)), **fields}


def _chat(rng: random.Random, model: str, **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": _chat_messages(rng), "max_tokens": rng.randint(8, 64),
            "temperature": rng.choice((0.0, 0.7)), **fields}


def _response(rng: random.Random, model: str, **fields: Any) -> dict[str, Any]:
    messages = _chat_messages(rng)
    instructions = {"instructions": messages[0]["content"]} if len(messages) == 2 else {}
    return {"model": model, "input": messages[-1]["content"], **instructions,
            "max_output_tokens": rng.randint(8, 64), "temperature": rng.choice((0.0, 0.7)), **fields}


def _message(rng: random.Random, model: str, **fields: Any) -> dict[str, Any]:
    messages = _chat_messages(rng)
    system = {"system": messages[0]["content"]} if len(messages) == 2 else {}
    return {"model": model, "messages": messages[-1:], **system, "max_tokens": rng.randint(8, 64),
            "temperature": rng.choice((0.0, 0.7)), **fields}


COMPLETIONS, CHAT, RESPONSES, MESSAGES = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"
BODIES = {COMPLETIONS: _completion, CHAT: _chat, RESPONSES: _response, MESSAGES: _message}
"""Each route's request body of the mix."""
NAMED_EVENT_ROUTES = {RESPONSES: ("response.completed", "response.incomplete"), MESSAGES: ("message_stop",)}
"""Routes whose streams are named events, and the events that end them (no `data: [DONE]`)."""
_STREAM = {"stream": True, "stream_options": {"include_usage": True}}
MIX = (  # kind, weight, path, fields beyond the prompt, max_tokens, temperature and seed
    ("completion", 3, COMPLETIONS, {}),
    ("completion_stream", 3, COMPLETIONS, _STREAM),
    ("chat", 3, CHAT, {}),
    ("chat_stream", 3, CHAT, _STREAM),
    ("completion_n2_logprobs", 1, COMPLETIONS, {"n": 2, "temperature": 0.8, "logprobs": 2}),
    ("chat_n2_stream", 1, CHAT, {"n": 2, "temperature": 0.8, **_STREAM}),
    ("chat_logprobs_stream", 1, CHAT, {"logprobs": True, "top_logprobs": 2, **_STREAM}),
    ("completion_stop", 2, COMPLETIONS, {"stop": ["."]}),
    ("responses", 1, RESPONSES, {}),
    ("responses_stream", 1, RESPONSES, {"stream": True}),
    ("messages", 1, MESSAGES, {}),
    ("messages_stream", 1, MESSAGES, {"stream": True}),
)


def valid_spec(rng: random.Random, model: str) -> Spec:
    """A request the server must answer in full, drawn from MIX."""
    kind, _, path, fields = rng.choices(MIX, [weight for _, weight, _, _ in MIX])[0]
    seed = {"seed": rng.randint(0, 999)} if path in (COMPLETIONS, CHAT) else {}  # vLLM's extra
    return Spec(kind, path, BODIES[path](rng, model, **{**seed, **fields}))


def invalid_spec(rng: random.Random, model: str, max_model_len: int) -> Spec:
    """A request the server must refuse with this exact status, in OpenAI's error shape."""
    path, body, status = rng.choice((
        (COMPLETIONS, b"{not json", 400),
        (COMPLETIONS, {"model": model, "prompt": "hi", "temperature": -1}, 400),
        (COMPLETIONS, {"model": model, "prompt": "hi", "tempreature": 0.5}, 400),
        (COMPLETIONS, {"model": "no-such-model", "prompt": "hi"}, 404),
        (COMPLETIONS, {"model": model, "prompt": "hi", "max_tokens": max_model_len}, 400),
        (CHAT, {"model": model, "messages": []}, 400),
        (CHAT, {"model": model, "messages": "hello"}, 400),
        (RESPONSES, {"model": model, "input": ""}, 400),
        (MESSAGES, {"model": model, "messages": [{"role": "user", "content": "hi"}]}, 400),
        (MESSAGES, {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                    "temperature": 2}, 400),
    ))
    return Spec("invalid", path, body, expect_status=status)


def cut_spec(rng: random.Random, model: str) -> Spec:
    """A long stream (EOS ignored) that the client closes after 1-16 events: after the first one the request
    is surely in the engine, so every cut must show up on /metrics as one abort."""
    path = rng.choice((COMPLETIONS, CHAT))
    body = (_chat if path == CHAT else _completion)(rng, model, stream=True, ignore_eos=True)
    body["max_tokens"] = rng.randint(64, 256)
    return Spec("cut_stream", path, body, cut_after=rng.randint(1, 16))


# -- sending and checking ----------------------------------------------------------------------------------


async def send(http: httpx.AsyncClient, spec: Spec) -> Result:
    try:
        if isinstance(spec.body, dict) and spec.body.get("stream"):
            return await _send_stream(http, spec)
        content = spec.body if isinstance(spec.body, bytes) else json.dumps(spec.body).encode()
        response = await http.post(spec.path, content=content, headers={"Content-Type": "application/json"})
        return _check_response(spec, response)
    except httpx.TransportError as e:
        return Result("transport_error", detail=f"{spec.kind}: {type(e).__name__}: {e}")
    except (ValueError, KeyError, TypeError) as e:  # a body that is not the JSON it should be
        return Result("bad_response", detail=f"{spec.kind}: {type(e).__name__}: {e}")


def _status_error(spec: Spec, response: httpx.Response, text: str) -> Result:
    """A status other than the expected one: TURNED_AWAY for a 503 with Retry-After in the route's error
    shape (the server is full), else an error."""
    status, retry_after = response.status_code, response.headers.get("Retry-After")
    if status == 503 and retry_after is not None and _error_shaped(spec.path, text):
        return Result(TURNED_AWAY, retry_after_s=float(retry_after))
    outcome = "http_5xx" if status >= 500 else "unexpected_status"
    return Result(outcome, detail=f"{spec.kind}: HTTP {status} (expected {spec.expect_status}): {text[:300]}")


def _error_shaped(path: str, text: str) -> bool:
    """Whether `text` is an error body in the route's shape: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return False
    if path == MESSAGES:
        return body.get("type") == "error" and {"type", "message"} <= error.keys()
    return {"message", "type", "param", "code"} <= error.keys()


def _check_response(spec: Spec, response: httpx.Response) -> Result:
    if response.status_code != spec.expect_status:
        return _status_error(spec, response, response.text)
    body = response.json()
    if spec.expect_status != 200:
        if not _error_shaped(spec.path, response.text):
            return Result("bad_response", detail=f"{spec.kind}: not the route's error shape: {response.text[:300]}")
        return Result(REJECTED)
    if spec.path == RESPONSES:
        done = body.get("status") in ("completed", "incomplete") and body.get("output")
        return Result(OK, body["usage"]["output_tokens"]) if done else \
            Result("bad_response", detail=f"{spec.kind}: status {body.get('status')!r}, output {body.get('output')}")
    if spec.path == MESSAGES:
        done = body.get("type") == "message" and body.get("stop_reason") in ("end_turn", "max_tokens", "stop_sequence")
        return Result(OK, body["usage"]["output_tokens"]) if done else \
            Result("bad_response", detail=f"{spec.kind}: {response.text[:300]}")
    n = spec.body.get("n", 1)
    choices = body.get("choices", [])
    problem = None
    if sorted(c["index"] for c in choices) != list(range(n)):
        problem = f"choice indices {[c['index'] for c in choices]} for n={n}"
    elif any(c["finish_reason"] not in ("stop", "length") for c in choices):
        problem = f"finish reasons {[c['finish_reason'] for c in choices]}"
    elif "logprobs" in spec.body and any(not (c.get("logprobs") or {}).get("tokens") for c in choices):
        problem = "logprobs asked for but missing"
    elif "stop" in spec.body and any(s in c["text"] for c in choices for s in spec.body["stop"]):
        problem = f"a stop string left in the text: {[c['text'] for c in choices]}"
    if problem:
        return Result("bad_response", detail=f"{spec.kind}: {problem}")
    return Result(OK, body["usage"]["completion_tokens"])


async def _send_stream(http: httpx.AsyncClient, spec: Spec) -> Result:
    async with http.stream("POST", spec.path, json=spec.body) as response:
        if response.status_code != spec.expect_status:
            return _status_error(spec, response, (await response.aread()).decode(errors="replace"))
        if spec.path in NAMED_EVENT_ROUTES:
            return await _named_events(spec, response)
        num_events, done, usage = 0, False, None
        finished: set[int] = set()
        saw_logprobs = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return Result("bad_response", detail=f"{spec.kind}: error event: {line[:300]}")
            num_events += 1
            if num_events == spec.cut_after:
                return Result(CUT)  # leaving the block closes the connection mid-stream
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                saw_logprobs |= bool(choice.get("logprobs"))
                if choice.get("finish_reason") is not None:
                    finished.add(choice["index"])
    if spec.cut_after is not None:
        return Result(FINISHED_BEFORE_CUT if done else "bad_response",
                      detail="" if done else f"{spec.kind}: stream ended without [DONE]")
    problem = None
    if not done:
        problem = "no [DONE]"
    elif finished != set(range(spec.body.get("n", 1))):
        problem = f"finish reasons for choices {sorted(finished)} only"
    elif usage is None:
        problem = "no usage chunk"
    elif spec.body.get("logprobs") and not saw_logprobs:
        problem = "logprobs asked for but missing"
    if problem:
        return Result("bad_response", detail=f"{spec.kind}: {problem}")
    return Result(OK, usage["completion_tokens"])


async def _named_events(spec: Spec, response: httpx.Response) -> Result:
    """A Responses or Messages stream: `event: <type>` lines, ended by the route's last event (its usage
    in it, or in Messages' `message_delta`), or cut after `spec.cut_after` events."""
    num_events, name, output_tokens = 0, "", None
    async for line in response.aiter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
            continue
        if not line.startswith("data: "):
            continue
        if name == "error":
            return Result("bad_response", detail=f"{spec.kind}: error event: {line[:300]}")
        num_events += 1
        if num_events == spec.cut_after:
            return Result(CUT)
        data = json.loads(line[len("data: "):])
        usage = (data.get("response") or {}).get("usage") or data.get("usage")
        output_tokens = usage["output_tokens"] if usage else output_tokens
        if name in NAMED_EVENT_ROUTES[spec.path]:
            break
    finished = name in NAMED_EVENT_ROUTES[spec.path]
    if spec.cut_after is not None:
        return Result(FINISHED_BEFORE_CUT if finished else "bad_response",
                      detail="" if finished else f"{spec.kind}: stream ended without {name!r}")
    if not finished or output_tokens is None:
        return Result("bad_response", detail=f"{spec.kind}: last event {name!r}, output tokens {output_tokens}")
    return Result(OK, output_tokens)


# -- the run ---------------------------------------------------------------------------------------------


@dataclass
class Load:
    """What the clients share: the run's schedule and what has happened so far."""

    start: float
    model: str
    duration_s: float
    num_aborts: int
    max_model_len: int
    invalid_fraction: float
    outcomes: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    num_errors: int = 0
    completion_tokens: int = 0
    latencies: list[float] = field(default_factory=list)

    def next_spec(self, rng: random.Random) -> Spec:
        if rng.random() < self.invalid_fraction:
            return invalid_spec(rng, self.model, self.max_model_len)
        return valid_spec(rng, self.model)

    async def run(self, http: httpx.AsyncClient, spec: Spec) -> str:
        """Send `spec` and record its result; after a turn-away, wait as long as the server asked (as the
        openai client does before it retries). The outcome."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        result = await send(http, spec)
        self.record(spec, result, loop.time() - start)
        if result.outcome == TURNED_AWAY:
            await asyncio.sleep(result.retry_after_s)
        return result.outcome

    async def run_admitted(self, http: httpx.AsyncClient, spec: Spec) -> None:
        """Send `spec` again after each turn-away until it is admitted (a cut stream must be cut), while
        the run lasts."""
        loop = asyncio.get_running_loop()
        while await self.run(http, spec) == TURNED_AWAY and loop.time() < self.start + self.duration_s:
            pass

    def record(self, spec: Spec, result: Result, latency_s: float) -> None:
        self.outcomes[result.outcome] += 1
        self.by_kind[(spec.kind, result.outcome)] += 1
        if result.outcome == OK:
            self.completion_tokens += result.completion_tokens
            self.latencies.append(latency_s)
        if result.outcome not in EXPECTED_OUTCOMES:
            self.num_errors += 1
            if len(self.errors) < MAX_ERROR_SAMPLES:
                self.errors.append(result.detail)


async def client_loop(http: httpx.AsyncClient, load: Load, rng: random.Random) -> None:
    """One client: a request of the mix after another until the run's time is up."""
    loop = asyncio.get_running_loop()
    while loop.time() < load.start + load.duration_s:
        await load.run(http, load.next_spec(rng))


async def cut_loop(http: httpx.AsyncClient, load: Load, rng: random.Random) -> None:
    """Starts the cut streams on their own schedule, evenly over the run (cut k at (k + 0.5) / num_aborts
    of it), beside the clients, so that slow responses never skip one."""
    loop = asyncio.get_running_loop()
    streams = []
    for k in range(load.num_aborts):
        await asyncio.sleep(max(0.0, load.start + (k + 0.5) * load.duration_s / load.num_aborts - loop.time()))
        streams.append(asyncio.create_task(load.run_admitted(http, cut_spec(rng, load.model))))
    await asyncio.gather(*streams)


def server_rss(pid: int) -> tuple[int, int]:
    """Resident bytes of the process and of all its descendants (the engine core is a child)."""
    process = psutil.Process(pid)
    children = 0
    for child in process.children(recursive=True):
        try:
            children += child.memory_info().rss
        except psutil.NoSuchProcess:  # a helper process that just exited
            pass
    return process.memory_info().rss, children


async def sample_rss(pid: int, interval_s: float, start: float, samples: list[tuple[float, int, int]]) -> None:
    loop = asyncio.get_running_loop()
    while True:
        samples.append((loop.time() - start, *server_rss(pid)))
        await asyncio.sleep(interval_s)  # a sampling period, not synchronization


async def wait_idle(url: str, timeout_s: float) -> tuple[bool, dict[str, float]]:
    """Poll /metrics until the server is idle; (reached, last samples)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        samples = await asyncio.to_thread(metric_samples, url)
        if is_idle(samples) or loop.time() > deadline:
            return is_idle(samples), samples
        await asyncio.sleep(0.25)  # polling interval, bounded by the deadline


async def drive(url: str, pid: int | None, args: argparse.Namespace) -> dict[str, Any]:
    model = (await asyncio.to_thread(httpx.get, f"{url}/v1/models", timeout=30)).json()["data"][0]
    before = await asyncio.to_thread(metric_samples, url)
    loop = asyncio.get_running_loop()
    load = Load(loop.time(), model["id"], args.duration_s, args.num_aborts, model["max_model_len"],
                args.invalid_fraction)
    rss: list[tuple[float, int, int]] = []
    sampler = (asyncio.create_task(sample_rss(pid, args.rss_interval_s, load.start, rss))
               if pid is not None else None)
    # No connection limit: a cut stream must start on time even while every client is waiting.
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        await asyncio.gather(cut_loop(http, load, random.Random(args.seed)),
                             *[client_loop(http, load, random.Random(args.seed * 1000 + i + 1))
                               for i in range(args.concurrency)])
    elapsed = loop.time() - load.start
    if sampler is not None:
        sampler.cancel()
    idle, after = await wait_idle(url, args.idle_timeout_s)
    kv_usage = after["pagellm:kv_cache_usage_perc"]
    return {
        "elapsed_s": elapsed,
        "outcomes": dict(load.outcomes),
        "by_kind": {f"{kind}:{outcome}": n for (kind, outcome), n in sorted(load.by_kind.items())},
        # Streams to cut that the server admitted (a turned-away attempt is sent again while the run lasts).
        "num_cuts": sum(n for (kind, outcome), n in load.by_kind.items()
                        if kind == "cut_stream" and outcome != TURNED_AWAY),
        "num_errors": load.num_errors,
        "num_5xx": load.outcomes.get("http_5xx", 0),
        "num_turned_away": load.outcomes.get(TURNED_AWAY, 0),
        "error_samples": load.errors,
        "requests_per_s": sum(load.outcomes.values()) / elapsed,
        "output_tok_per_s": load.completion_tokens / elapsed,
        "ok_latency_s": summarize(load.latencies),
        "server_aborts": after["pagellm:request_success_total{abort}"] - before["pagellm:request_success_total{abort}"],
        "preemptions": after["pagellm:num_preemptions_total"] - before["pagellm:num_preemptions_total"],
        "idle": {"reached": idle, "running": after["pagellm:num_requests_running"],
                 "waiting": after["pagellm:num_requests_waiting"], "kv_cache_usage": kv_usage,
                 "leaked_blocks": None if args.num_blocks is None else round(kv_usage * args.num_blocks)},
        "rss": rss_summary(rss, args.warmup_s, args.duration_s) if pid is not None else None,
    }


def rss_summary(samples: list[tuple[float, int, int]], warmup_s: float, duration_s: float) -> dict[str, Any]:
    """Median RSS over the first window after the warm-up and over the last window of the load, and the
    growth between, for the server in all and for the API process and its children (the engine core)
    apart. Medians over a window (a tenth of the run, at most a minute), so that one sample taken
    during a burst of in-flight requests does not decide the result."""
    window_s = min(60.0, duration_s / 10)
    under_load = [s for s in samples if warmup_s <= s[0] <= duration_s] or samples
    first_s, last_s = under_load[0][0], under_load[-1][0]

    def mib(window: list[tuple[float, int, int]], part: slice) -> float:
        return statistics.median(sum(s[part]) for s in window) / (1 << 20)

    start_window = [s for s in under_load if s[0] <= first_s + window_s]
    end_window = [s for s in under_load if s[0] >= last_s - window_s]
    summary: dict[str, Any] = {"window_s": window_s, "start_window_at_s": first_s, "end_window_at_s": last_s - window_s}
    for name, part in (("", slice(1, 3)), ("api_", slice(1, 2)), ("engine_core_", slice(2, 3))):
        summary[f"{name}start_mib"], summary[f"{name}end_mib"] = mib(start_window, part), mib(end_window, part)
    summary["growth"] = summary["end_mib"] / summary["start_mib"] - 1
    summary["peak_mib"] = max(api + children for _, api, children in samples) / (1 << 20)
    # [seconds, API process MiB, its children's MiB]
    summary["samples"] = [[round(t, 1), round(api / (1 << 20), 1), round(children / (1 << 20), 1)]
                          for t, api, children in samples]
    return summary


def goals(report: dict[str, Any]) -> dict[str, bool]:
    rss = report["rss"]
    return {
        "no_errors": report["num_errors"] == 0,
        "idle_at_end": report["idle"]["reached"],
        "no_leaked_blocks": report["idle"]["kv_cache_usage"] == 0,
        "rss_growth_under_5pct": rss is None or rss["growth"] < MAX_RSS_GROWTH,
        "clean_shutdown": report.get("server_exit_code", 0) == 0,
    }


def print_report(report: dict[str, Any]) -> None:
    print(format_table(["outcome", "requests"], sorted(report["outcomes"].items())))
    print()
    rss = report["rss"] or {}
    rows = [["elapsed s", report["elapsed_s"]], ["cut streams", report["num_cuts"]],
            ["turned away (503 + Retry-After)", report["num_turned_away"]], ["5xx", report["num_5xx"]],
            ["aborts seen by the server", report["server_aborts"]], ["preemptions", report["preemptions"]],
            ["unexpected errors", report["num_errors"]], ["requests/s", report["requests_per_s"]],
            ["output tok/s", report["output_tok_per_s"]], ["RSS start MiB", rss.get("start_mib", "-")],
            ["RSS end MiB", rss.get("end_mib", "-")], ["RSS growth %", 100 * rss["growth"] if rss else "-"],
            ["  API process start/end MiB", f"{rss['api_start_mib']:.0f}/{rss['api_end_mib']:.0f}" if rss else "-"],
            ["  engine core start/end MiB",
             f"{rss['engine_core_start_mib']:.0f}/{rss['engine_core_end_mib']:.0f}" if rss else "-"],
            ["KV usage after idle", report["idle"]["kv_cache_usage"]],
            ["leaked blocks", report["idle"]["leaked_blocks"]]]
    rows += [[f"goal {name}", "met" if met else "MISSED"] for name, met in report["goals"].items()]
    print(format_table(["measure", "value"], rows))
    for detail in report["error_samples"][:10]:
        print("error:", detail)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.num_aborts < 0 or args.duration_s <= 0 or args.concurrency < 1:
        raise ValueError("--duration-s and --concurrency must be positive and --num-aborts at least 0")
    if args.url is not None:
        report = asyncio.run(drive(args.url, args.server_pid, args))
    else:
        args.num_blocks = args.num_gpu_blocks_override
        server = RemoteServer(args.model or default_model_path(), *_engine_flags(args))
        try:
            report = asyncio.run(drive(server.url, server.process.pid, args))
            report["server_log_errors"] = [line for line in server.log_tail(LOG_CHARS).splitlines()
                                           if "Traceback" in line or " ERROR " in line][:MAX_ERROR_SAMPLES]
        finally:
            exit_code = server.stop()
        report["server_exit_code"] = exit_code
    report["goals"] = goals(report)
    payload = {"benchmark": "soak", **run_metadata(), "parameters": vars(args), **report}
    print_report(report)
    if not args.no_save:
        print("wrote", write_json(payload, args.output or default_result_path("soak")))
    return 0 if all(report["goals"].values()) else 1


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--served-model-name", SERVED_NAME, "--max-model-len", str(args.max_model_len),
             "--num-gpu-blocks-override", str(args.num_gpu_blocks_override), "--dtype", args.dtype]
    for name in ("device", "max_seqs_in_flight", "max_waiting_requests", "queue_timeout"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--url", default=None, help="drive this running server instead of starting one")
    p.add_argument("--server-pid", type=int, default=None, help="with --url: the server's pid, for RSS samples")
    p.add_argument("--num-blocks", type=int, default=None, help="with --url: its KV blocks, to count leaked ones")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-gpu-blocks-override", type=int, default=320,
                   help="KV blocks of the started server: few enough that n > 1 bursts preempt now and then")
    p.add_argument("--max-seqs-in-flight", type=int, default=None,
                   help="of the started server: with fewer than --concurrency, clients are turned away (503)")
    p.add_argument("--max-waiting-requests", type=int, default=None, help="of the started server")
    p.add_argument("--queue-timeout", type=float, default=None, help="of the started server, in seconds")
    p.add_argument("--duration-s", type=float, default=1200.0)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--num-aborts", type=int, default=1000, help="streams cut by the client, spread over the run")
    p.add_argument("--invalid-fraction", type=float, default=0.03)
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS growth is measured from the samples after")
    p.add_argument("--rss-interval-s", type=float, default=5.0)
    p.add_argument("--idle-timeout-s", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="result path; default benchmarks/results/soak_<UTC stamp>.json")
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
