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
import socket
import subprocess
import sys
import time
from typing import Any

import httpx

from pagellm import LLM, SamplingParams
from pagellm.benchmarks.datasets import BenchRequest, random_requests_in_range
from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.loader import default_model_path, resolve_model

HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    model = args.model or default_model_path()
    vocab = resolve_model(model).arch.vocab_size
    requests = random_requests_in_range(args.num_prompts, args.min_input_len, args.max_input_len,
                                        args.output_len, vocab, args.seed)
    engine_flags = {"device": args.device, "dtype": args.dtype, "max_model_len": args.max_model_len,
                    "enable_prefix_caching": False}
    payload: dict[str, Any] = {"benchmark": "serving", **run_metadata(), "parameters": {
        "model": model, "num_prompts": args.num_prompts, "min_input_len": args.min_input_len,
        "max_input_len": args.max_input_len, "output_len": args.output_len, "seed": args.seed,
        "engine": engine_flags, "total_input_tokens": sum(len(r.prompt_token_ids) for r in requests)}}

    payload["http"] = _run_http(model, requests, engine_flags, args)
    payload["offline"] = _run_offline(model, requests, engine_flags)
    payload["http_over_offline"] = payload["http"]["output_tok_per_s"] / payload["offline"]["output_tok_per_s"]
    rows = [["http (pagellm serve)", payload["http"]["elapsed_s"], payload["http"]["output_tok_per_s"],
             payload["http_over_offline"]],
            ["offline (LLM.generate)", payload["offline"]["elapsed_s"], payload["offline"]["output_tok_per_s"], 1.0]]
    print(format_table(["path", "seconds", "output tok/s", "ratio vs offline"], rows))
    if not args.no_save:
        print("wrote", write_json(payload, default_result_path("serving")))
    return payload


def _run_http(model: str, requests: list[BenchRequest], engine_flags: dict, args: argparse.Namespace) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", model, "--host", HOST, "--port", str(port),
           "--device", engine_flags["device"], "--dtype", engine_flags["dtype"],
           "--max-model-len", str(engine_flags["max_model_len"]), "--no-enable-prefix-caching",
           "--served-model-name", "bench"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_ready(f"http://{HOST}:{port}/health", server)
        return asyncio.run(_send_all(f"http://{HOST}:{port}/v1/completions", requests))
    finally:
        server.terminate()
        server.wait(timeout=60)


async def _send_all(url: str, requests: list[BenchRequest]) -> dict:
    limits = httpx.Limits(max_connections=len(requests) + 8)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        # A short warm-up request, not timed.
        await _one(client, url, BenchRequest(requests[0].prompt_token_ids[:8], 4))
        start = time.perf_counter()
        counts = await asyncio.gather(*[_one(client, url, r) for r in requests])
        elapsed = time.perf_counter() - start
    tokens = sum(counts)
    expected = sum(r.output_len for r in requests)
    if tokens != expected:
        raise RuntimeError(f"HTTP run produced {tokens} tokens, {expected} were requested")
    return {"elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
            "requests_per_s": len(requests) / elapsed}


async def _one(client: httpx.AsyncClient, url: str, request: BenchRequest) -> int:
    """Stream one completion; returns its completion_tokens from the final usage chunk."""
    body = {"model": "bench", "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    completion_tokens = 0
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    return completion_tokens


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
    p.add_argument("--no-save", action="store_true")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
