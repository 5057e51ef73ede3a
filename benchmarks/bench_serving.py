"""Throughput through HTTP at saturation against offline throughput, same model, machine and prompts.

Starts `pagellm serve` on 127.0.0.1 (loopback only), sends every request at once as streamed
`/v1/completions` calls (token-id prompts, greedy, EOS ignored, a fixed number of output tokens),
then runs the same requests through the offline `LLM.generate` in this process. Both engines use
the same engine arguments. The goal is HTTP throughput >= 90% of offline.

    .venv/bin/python -m benchmarks.bench_serving                      # SmolLM2 on the CPU
    .venv/bin/python -m benchmarks.bench_serving --num-prompts 8 --output-len 8 --no-save
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.datasets import BenchRequest, load_requests, random_requests_in_range
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, summarize, write_json
from pagellm.loader import default_model_path, resolve_model

HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    model = args.model or default_model_path()
    vocab = resolve_model(model, args.load_format).arch.vocab_size
    if args.requests:  # e.g. benchmarks/data/sharegpt_1000_seed0.json.gz (gpu_fast_path's ShareGPT sample)
        requests = load_requests(args.requests)[0][:args.num_prompts]
    else:
        requests = random_requests_in_range(args.num_prompts, args.min_input_len, args.max_input_len,
                                            args.output_len, vocab, args.seed)
    engine_flags = {"device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
                    "enable_prefix_caching": False, "load_format": args.load_format, "max_num_seqs": args.max_num_seqs}
    payload: dict[str, Any] = {"benchmark": "serving", **run_metadata(), "parameters": {
        "model": model, "num_prompts": args.num_prompts, "min_input_len": args.min_input_len,
        "max_input_len": args.max_input_len, "output_len": args.output_len, "seed": args.seed,
        "engine": engine_flags, "total_input_tokens": sum(len(r.prompt_token_ids) for r in requests)}}

    payload["http"] = _run_http(model, requests, engine_flags, args)
    payload["offline"] = _run_offline(model, requests, engine_flags)
    payload["http_over_offline"] = payload["http"]["output_tok_per_s"] / payload["offline"]["output_tok_per_s"]
    rows = [["http (pagellm serve)", payload["http"]["elapsed_s"], payload["http"]["requests_per_s"],
             payload["http"]["output_tok_per_s"], payload["http_over_offline"]],
            ["offline (LLM.generate)", payload["offline"]["elapsed_s"], payload["offline"]["requests_per_s"],
             payload["offline"]["output_tok_per_s"], 1.0]]
    print(format_table(["path", "seconds", "requests/s", "output tok/s", "ratio vs offline"], rows))
    print(format_table(["HTTP latency (ms)", "mean", "p50", "p99"],
                       [[name, *(f"{payload['http'][name][k] * 1e3:.1f}" for k in ("mean", "p50", "p99"))]
                        for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s") if payload["http"][name]["count"]]))
    if not args.no_save:
        print("wrote", write_json(payload, args.output or default_result_path("serving")))
    return payload


def _run_http(model: str, requests: list[BenchRequest], engine_flags: dict, args: argparse.Namespace) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm.cli", "serve", model, "--host", HOST, "--port", str(port),
           "--device", engine_flags["device"], "--dtype", engine_flags["dtype"],
           "--max-model-len", str(engine_flags["max_model_len"]), "--no-enable-prefix-caching",
           "--load-format", engine_flags["load_format"], "--max-num-seqs", str(engine_flags["max_num_seqs"]),
           "--served-model-name", "bench"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spy = None
    try:
        _wait_ready(f"http://{HOST}:{port}/health", server)
        if args.py_spy:  # sample the server's processes (API and engine core) during the run
            spy = subprocess.Popen([args.py_spy_bin, "record", "--pid", str(server.pid), "--subprocesses", "--format",
                                    "raw", "--rate", "100", "--output", args.py_spy],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        result = asyncio.run(_send_all(f"http://{HOST}:{port}/v1/completions", requests))
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=120)
            result["profile"] = profile_summary(args.py_spy)
        return result
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        server.terminate()
        server.wait(timeout=60)


def profile_summary(raw_path: str, top: int = 40) -> dict[str, list[tuple[str, float]]]:
    """Per sampled process, the functions on the most samples' stacks (share of its samples),
    from py-spy's raw output (one 'frame;frame;... count' line per stack)."""
    counts: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    with open(raw_path, encoding="utf-8") as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            depth = next((i for i, frame in enumerate(frames) if not frame.startswith("process ")), len(frames))
            process = frames[depth - 1] if depth else "process"  # the innermost process
            frames = [frame for frame in frames[depth:] if frame.endswith(")")]  # (a command line may hold ';')
            totals[process] += int(n)
            for frame in set(frames):
                counts[process][frame] += int(n)
    return {process: [(frame, n / totals[process]) for frame, n in found.most_common(top)]
            for process, found in counts.items()}


async def _send_all(url: str, requests: list[BenchRequest]) -> dict:
    limits = httpx.Limits(max_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        # A short warm-up request, not timed.
        await _one(client, url, BenchRequest(requests[0].prompt_token_ids[:8], 4))
        start = time.perf_counter()
        streams = await asyncio.gather(*[_one(client, url, r) for r in requests])
        elapsed = time.perf_counter() - start
    tokens = sum(s.completion_tokens for s in streams)
    expected = sum(r.output_len for r in requests)
    if tokens != expected:
        raise RuntimeError(f"HTTP run produced {tokens} tokens, {expected} were requested")
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
            "requests_per_s": len(requests) / elapsed,
            "ttft_s": summarize([s.events[0] - s.start for s in streams if s.events]),
            "tpot_s": summarize([(s.events[-1] - s.events[0]) / (s.completion_tokens - 1)
                                 for s in streams if s.events and s.completion_tokens > 1]),
            "itl_s": summarize([b - a for s in streams for a, b in zip(s.events, s.events[1:])]),
            "e2e_s": summarize([s.end - s.start for s in streams]),
            "events_per_stream": sum(len(s.events) for s in streams) / len(streams)}


@dataclass(slots=True)
class _Stream:
    """One streamed completion as the client saw it."""

    start: float
    end: float = 0.0
    events: list[float] = field(default_factory=list)
    """Arrival time of each event that carried output."""
    completion_tokens: int = 0


async def _one(client: httpx.AsyncClient, url: str, request: BenchRequest) -> _Stream:
    """Stream one completion: when each event with output came, and the completion_tokens of the
    final usage chunk."""
    body = {"model": "bench", "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stream = _Stream(time.perf_counter())
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("choices"):
                stream.events.append(time.perf_counter())
            if chunk.get("usage"):
                stream.completion_tokens = chunk["usage"]["completion_tokens"]
    stream.end = time.perf_counter()
    return stream


def _run_offline(model: str, requests: list[BenchRequest], engine_flags: dict) -> dict:
    llm = LLM(model, **engine_flags)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
            "requests_per_s": len(requests) / elapsed}


def _wait_ready(url: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with code {server.returncode} before becoming ready")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a readiness endpoint, bounded by the deadline
    raise RuntimeError(f"server not ready within {READY_TIMEOUT_S:.0f} s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-input-len", type=int, default=32)
    p.add_argument("--max-input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--load-format", default="auto", help="dummy: random weights (a config-only folder or a preset)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--requests", default=None,
                   help="pre-sampled requests (a save_requests file, e.g. benchmarks/data/sharegpt_1000_seed0.json.gz) "
                        "instead of random prompts; --num-prompts takes the first ones")
    p.add_argument("--no-save", action="store_true")
    p.add_argument("--py-spy", default=None, metavar="RAW",
                   help="record the server's processes with py-spy into this file; the JSON gets the top functions")
    p.add_argument("--py-spy-bin", default="py-spy")
    p.add_argument("--output", default=None, help="JSON path; default benchmarks/results/serving_<UTC time>.json")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
