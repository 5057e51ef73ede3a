"""The numbers of a `bench serve` run, under vLLM's result keys (`completed`, `request_throughput`,
`mean_ttft_ms`, `p99_tpot_ms`, ...) so that notebooks written for vLLM's serving benchmark read them.

Per request: TTFT is the time to the first content chunk; TPOT is (end-to-end - TTFT) / (output
tokens - 1), for requests of two tokens or more; ITL is every gap between content chunks; E2EL is
the end-to-end latency. Goodput counts the requests within every limit given with --goodput.
"""
from __future__ import annotations

import statistics
from typing import Any

import numpy as np

from pagellm.benchmarks.results import format_table
from pagellm.benchmarks.serve_client import LoadResult, RequestResult

METRICS = {"ttft": "time to first token", "tpot": "time per output token", "itl": "inter-token latency",
           "e2el": "end-to-end latency"}
PERCENTILES = (50, 90, 99)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` (--goodput, milliseconds) -> {"ttft": 500.0, "tpot": 50.0}."""
    limits: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or name not in GOODPUT_METRICS or not ms > 0:
            raise ValueError(f"--goodput takes METRIC:MILLISECONDS with METRIC one of {', '.join(GOODPUT_METRICS)} "
                             f"and a positive number, got {item!r}")
        limits[name] = ms
    return limits


def request_ms(result: RequestResult) -> dict[str, float | None]:
    """TTFT, TPOT (None below two tokens) and E2EL of one finished request, in milliseconds."""
    tpot = ((result.latency_s - result.ttft_s) / (result.output_tokens - 1) * 1e3
            if result.output_tokens > 1 else None)
    return {"ttft": result.ttft_s * 1e3, "tpot": tpot, "e2el": result.latency_s * 1e3}


def summarize(load: LoadResult, goodput: dict[str, float]) -> dict[str, Any]:
    """Counts, rates, latency statistics and the per-request lists, under vLLM's keys."""
    done = [r for r in load.results if r.success]
    per_request = [request_ms(r) for r in done]
    values = {
        "ttft": [m["ttft"] for m in per_request],
        "tpot": [m["tpot"] for m in per_request if m["tpot"] is not None],
        "itl": [gap * 1e3 for r in done for gap in r.itl_s],
        "e2el": [m["e2el"] for m in per_request],
    }
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    duration = load.duration_s
    good = sum(all((m[k] or 0.0) <= limit for k, limit in goodput.items()) for m in per_request)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(done),
        "failed": len(load.results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "peak_concurrent_requests": load.peak_concurrency,
        "usage_from_server": all(r.usage_from_server for r in done),
    }
    for name, samples in values.items():
        out.update(_statistics(name, samples))
    out.update(input_lens=[r.prompt_tokens for r in done], output_lens=[r.output_tokens for r in done],
               ttfts=[r.ttft_s for r in done], itls=[r.itl_s for r in done],
               errors=[r.error for r in load.results if not r.success])
    return out


def _statistics(name: str, samples: list[float]) -> dict[str, float | None]:
    if not samples:
        keys = ["mean", "median", "std", *(f"p{p}" for p in PERCENTILES)]
        return {f"{k}_{name}_ms": None for k in keys}
    stats = {f"mean_{name}_ms": statistics.fmean(samples), f"median_{name}_ms": statistics.median(samples),
             f"std_{name}_ms": float(np.std(samples))}
    for p, value in zip(PERCENTILES, np.percentile(samples, PERCENTILES).tolist()):
        stats[f"p{p}_{name}_ms"] = value
    return stats


def format_summary(result: dict[str, Any]) -> str:
    """The table `bench serve` prints."""
    rows: list[list[Any]] = [
        ["successful requests", result["completed"]],
        ["failed requests", result["failed"]],
        ["benchmark duration (s)", result["duration"]],
        ["total input tokens", result["total_input_tokens"]],
        ["total output tokens", result["total_output_tokens"]],
        ["request throughput (req/s)", result["request_throughput"]],
    ]
    if result["request_goodput"] is not None:
        rows.append(["request goodput (req/s)", result["request_goodput"]])
    rows += [["output token throughput (tok/s)", result["output_throughput"]],
             ["total token throughput (tok/s)", result["total_token_throughput"]],
             ["peak concurrent requests", result["peak_concurrent_requests"]]]
    for name, title in METRICS.items():
        for stat in ("mean", "median", "p90", "p99"):
            value = result[f"{stat}_{name}_ms"]
            label = f"{stat} {name.upper()} (ms)" + (f", {title}" if stat == "mean" else "")
            rows.append([label, "-" if value is None else float(value)])
    table = format_table(["serving benchmark", "result"], rows, left=(0,))
    errors = result["errors"]
    if errors:
        table += f"\nfirst error of {len(errors)}: {errors[0]}"
    return table
