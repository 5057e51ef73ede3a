"""The router's overhead: `pagellm bench serve` against one `pagellm serve` directly and through a
`pagellm router` in front of it, in the same run with the same requests, the two in alternating
order round after round; reports the router's added p50 TTFT (ms) and its throughput ratio.

The engine's prefix cache and the router's response cache are off, so that a prompt sent a second
time (to the other target, or in the next round) costs what it cost the first time.

    python -m benchmarks.router_overhead            # the CPU, the embedded SmolLM2
    python -m benchmarks.router_overhead --backend null   # a backend that answers at once: the router alone
    python -m benchmarks.router_overhead --smoke

Prints a table and writes JSON under benchmarks/results/ (hardware, date, command, commit).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from pagellm.benchmarks.results import default_result_path, format_table, run_metadata, write_json
from pagellm.benchmarks.serve import ServeConfig, make_workload, run_serve
from pagellm.benchmarks.server_process import ServerProcess
from pagellm.loader.source import default_model_path

_SMOKE = {"num_prompts": 4, "input_len": 16, "output_len": 4, "max_concurrency": 2, "rounds": 1}
MODEL_NAME = "bench"
TARGETS = ("direct", "router")
GOALS = {"ttft_p50_added_ms": 2.0, "throughput_ratio": 0.95}
"""docs/router.md's overhead goals: <= 2 ms p50 TTFT added, >= 95% of the direct throughput."""
_DROPPED_KEYS = ("itls", "input_lens", "output_lens", "errors", "parameters", "dataset")
"""Per-request lists (TTFTs aside) and repeated inputs, left out of the JSON's per-run entries."""


class RouterProcess:
    """`pagellm router --config FILE` in front of `backend_url` on a free loopback port while the
    `with` block runs (no response cache: every request reaches the engine)."""

    def __init__(self, backend_url: str, startup_timeout_s: float = 120.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._config = tempfile.NamedTemporaryFile("w", suffix=".yaml")
        json.dump({"models": [{"name": MODEL_NAME, "backends": [backend_url]}], "cache": {"enabled": False}},
                  self._config)  # JSON is YAML
        self._config.flush()
        self._log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-router-", suffix=".log")
        self.command = [sys.executable, "-m", "pagellm.cli", "router", "--config", self._config.name,
                        "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"]
        self._startup_timeout_s = startup_timeout_s
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> RouterProcess:
        self._process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self._startup_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    self._log.seek(0)
                    raise ValueError(f"pagellm router exited with code {self._process.returncode}:\n"
                                     f"{self._log.read()[-3000:]}")
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return self
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.2)
        self.__exit__(None, None, None)
        raise ValueError(f"pagellm router was not ready within {self._startup_timeout_s:.0f} s")

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            self._process.wait(timeout=60)
        self._log.close()
        self._config.close()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _parse_args(argv)
    if args.smoke:
        for key, value in _SMOKE.items():
            setattr(args, key, value)
    engine_flags = ["--device", args.device, "--max-model-len", str(args.input_len + args.output_len + 64),
                    "--served-model-name", MODEL_NAME, "--no-enable-prefix-caching", "--load-format", args.load_format]
    tokenizer = args.tokenizer or default_model_path()
    if args.load_format == "dummy":  # random weights have no tokenizer: the workload's reads the text
        engine_flags += ["--tokenizer", tokenizer]
    config = ServeConfig(model=MODEL_NAME, tokenizer=tokenizer, num_prompts=args.num_prompts, input_len=args.input_len,
                         output_len=args.output_len, max_concurrency=args.max_concurrency, seed=args.seed,
                         num_warmups=args.num_warmups, disable_tqdm=True)
    workload = make_workload(config)  # the same prompts for both targets and every round
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in TARGETS}
    backend = (ServerProcess(args.model or None, engine_flags) if args.backend == "engine" else
               ServerProcess(None, ["--model", MODEL_NAME], launcher=[sys.executable, "-m", "benchmarks.null_backend"]))
    with backend as server, RouterProcess(server.url) as router:
        urls = {"direct": server.url, "router": router.url}
        for round_ in range(args.rounds):
            # Alternate which goes first, so that a drift of the machine's speed over the run
            # (another process, the CPU's clock) falls on both.
            for target in TARGETS if round_ % 2 == 0 else TARGETS[::-1]:
                result = run_serve(dataclasses.replace(config, base_url=urls[target]), workload)
                if result["failed"]:
                    raise RuntimeError(f"{target}: {result['failed']} requests failed: {result['errors'][:3]}")
                runs[target].append({k: v for k, v in result.items() if k not in _DROPPED_KEYS})
    summary = {t: _pooled(runs[t]) for t in TARGETS}
    added = summary["router"]["ttft_p50_ms"] - summary["direct"]["ttft_p50_ms"]
    ratio = summary["router"]["output_throughput"] / summary["direct"]["output_throughput"]
    overhead = {"ttft_p50_added_ms": added, "throughput_ratio": ratio,
                "meets_goals": added <= GOALS["ttft_p50_added_ms"] and ratio >= GOALS["throughput_ratio"]}
    payload = {"benchmark": "router_overhead", **run_metadata(args.commit),
               "parameters": {k: v for k, v in vars(args).items() if k not in ("out_dir", "commit")},
               "goals": GOALS, "summary": summary, "overhead": overhead, "runs": runs}
    print(_table(payload))
    if not args.smoke:
        write_json(payload, default_result_path("router_overhead"))
    if args.out_dir:
        write_json(payload, Path(args.out_dir) / default_result_path("router_overhead").name)
    return payload


def _pooled(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Every round's requests together: TTFT percentiles over all of them, throughput as all output
    tokens over all the rounds' time."""
    ttfts_ms = sorted(t * 1000 for r in runs for t in r["ttfts"])
    return {"ttft_p50_ms": statistics.median(ttfts_ms), "ttft_mean_ms": statistics.fmean(ttfts_ms),
            "output_throughput": sum(r["total_output_tokens"] for r in runs) / sum(r["duration"] for r in runs),
            "requests": len(ttfts_ms)}


def _table(payload: dict[str, Any]) -> str:
    rows = [[t, f"{s['ttft_p50_ms']:.1f}", f"{s['ttft_mean_ms']:.1f}", f"{s['output_throughput']:.1f}"]
            for t, s in payload["summary"].items()]
    o = payload["overhead"]
    rows.append(["router - direct", f"{o['ttft_p50_added_ms']:+.2f}", "", f"x{o['throughput_ratio']:.3f}"])
    return format_table(["target", "TTFT p50 ms", "TTFT mean ms", "output tok/s"], rows, left=[0])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="", help="model path; '': the embedded SmolLM2")
    p.add_argument("--backend", choices=["engine", "null"], default="engine",
                   help="engine: `pagellm serve`; null: benchmarks.null_backend, which answers at once, so the "
                        "router's own cost shows")
    p.add_argument("--tokenizer", default="", help="the prompts' tokenizer (a .gguf file or a directory with "
                   "tokenizer.json; with --load-format dummy also the server's); '': the embedded SmolLM2's")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto",
                   help="'dummy': random weights of a named model's shapes (a GPU host, where the router's own cost "
                        "is what is measured)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per target and round")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="runs per target, alternating which goes first")
    p.add_argument("--num-warmups", type=int, default=2, help="untimed requests before each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help=f"tiny sizes: {_SMOKE}")
    p.add_argument("--out-dir", default=None, help="also write the JSON here (e.g. $OUT)")
    p.add_argument("--commit", default=None, help="the code's commit, for a copy without git history")
    args = p.parse_args(argv)
    for flag in ("num_prompts", "input_len", "output_len", "max_concurrency", "rounds"):
        if getattr(args, flag) <= 0:
            p.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    return args


if __name__ == "__main__":
    main()
