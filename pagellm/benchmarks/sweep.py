"""`pagellm bench sweep`: `bench serve` over a ladder of loads, the knee, plots and a recommendation.

A ladder varies the request rate or the client's concurrency against one running server, or the
server's --max-num-seqs, starting `pagellm serve` for each rung. Every rung sends the same prompts.
The throughput knee is the first rung within --min-gain of the best output tokens/s of the ladder:
past it, more load buys little. For a load ladder (rates, concurrencies), the SLO limit is the last
rung before the first that breaks an --slo percentile or fails a request, and the recommendation
is the lower of the two. For the --max-num-seqs ladder, where a small setting can break the SLO by
queueing, the recommendation is the smallest setting within the SLO whose throughput is within
--min-gain of the best within it.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path
from typing import Any

from pagellm.benchmarks.results import format_table, run_metadata, write_json
from pagellm.benchmarks.serve import ServeConfig, make_workload, run_serve
from pagellm.benchmarks.serve_metrics import METRICS
from pagellm.benchmarks.server_process import ServerProcess
from pagellm.benchmarks.sweep_plots import plot_sweep

SLO_STATS = ("mean", "median", "p90", "p99")
SETTINGS_LADDER = "max-num-seqs"
"""The ladder that varies the server's settings rather than the load."""
_PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls")
"""Per-request lists of each rung's result, left out of sweep.json to keep it readable."""


def parse_slo(items: list[str]) -> dict[str, float]:
    """`["ttft_p99:2000"]` (--slo) -> {"p99_ttft_ms": 2000.0}: result keys and their limits."""
    limits = {}
    for item in items:
        name, sep, value = item.partition(":")
        metric, _, stat = name.partition("_")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not sep or metric not in METRICS or stat not in SLO_STATS or not ms > 0:
            raise ValueError(f"--slo takes METRIC_STAT:MILLISECONDS (METRIC one of {', '.join(METRICS)}, STAT one "
                             f"of {', '.join(SLO_STATS)}), e.g. ttft_p99:2000, got {item!r}")
        limits[f"{stat}_{metric}_ms"] = ms
    return limits


def run_cli(ns: argparse.Namespace) -> int:
    """`pagellm bench sweep`: run the ladder, write sweep.json and the plots, print the table and advice."""
    values = _check_ladder(ns.ladder, ns.values)
    slo = parse_slo(ns.slo)
    server_args = _split_server_args(ns.server_args)
    config = ServeConfig.from_namespace(ns)
    # Fail on a bad flag before the first rung; a max-num-seqs ladder makes its own --base-url.
    (config if ns.ladder != SETTINGS_LADDER else dataclasses.replace(config, base_url="http://127.0.0.1")).validate()
    metadata = run_metadata()
    rungs = run_ladder(config, ns.ladder, values, ns.server_model, server_args)
    analysis = analyze(rungs, ns.ladder, slo, ns.min_gain, ns.server_model, ns.server_args)
    out = Path(ns.output_dir)
    plots = plot_sweep(rungs, ns.ladder, slo, analysis, out)
    payload = {"benchmark": "sweep", **metadata, "ladder": ns.ladder, "values": values, "slo_ms": slo,
               "min_gain": ns.min_gain, "serve_parameters": {k: v for k, v in dataclasses.asdict(config).items()
                                                            if k != "api_key"},
               **analysis, "plots": [str(p) for p in plots], "rungs": rungs}
    print(format_rungs(rungs, ns.ladder, analysis))
    print(analysis["recommendation"])
    print("wrote", write_json(payload, out / "sweep.json"), *plots)
    return 0


def _check_ladder(ladder: str, values: list[float]) -> list[float]:
    if any(v <= 0 for v in values) or values != sorted(set(values)):
        raise ValueError(f"--values must be positive and increasing, got {values}")
    if ladder != "request-rate":
        if any(v != int(v) for v in values):
            raise ValueError(f"--values of a {ladder} ladder must be whole numbers, got {values}")
        return [int(v) for v in values]
    return values


def _split_server_args(text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise ValueError(f"--server-args must be flags quoted as for a shell, got {text!r} ({e})") from None


def run_ladder(config: ServeConfig, ladder: str, values: list[float], server_model: str | None,
               server_args: list[str]) -> list[dict[str, Any]]:
    """One `bench serve` result per rung (without the per-request lists), its load under `load`."""
    workload = make_workload(config)
    rungs = []
    for value in values:
        print(f"--- {ladder} {value}", flush=True)
        if ladder == SETTINGS_LADDER:
            # The ladder's --max-num-seqs comes last, so it wins over one in --server-args.
            with ServerProcess(server_model, [*server_args, "--max-num-seqs", str(value)]) as server:
                result = run_serve(dataclasses.replace(config, base_url=server.url), workload)
        else:
            field = {"request-rate": "request_rate", "max-concurrency": "max_concurrency"}[ladder]
            result = run_serve(dataclasses.replace(config, **{field: value}), workload)
        kept = {k: v for k, v in result.items() if k not in _PER_REQUEST_KEYS}
        rungs.append({"load": value, **kept})
    return rungs


def analyze(rungs: list[dict[str, Any]], ladder: str, slo: dict[str, float], min_gain: float,
            server_model: str | None = None, server_args: str = "") -> dict[str, Any]:
    """The knee, the rungs within the SLO and the recommendation (see the module docstring); indices
    into `rungs`."""
    throughput = [r["output_throughput"] for r in rungs]
    knee = plateau_start(throughput, range(len(rungs)), min_gain)
    passing = [i for i, rung in enumerate(rungs) if not slo_violations(rung, slo)]
    slo_limit = None
    if ladder == SETTINGS_LADDER:
        # A setting, not a load: a low one can break the SLO by queueing what a higher one runs at
        # once, so any rung may pass; the smallest that is near the best passing throughput wins.
        chosen = plateau_start(throughput, passing, min_gain) if passing else None
    else:
        # Latency grows with load: the limit is the last rung before the first one that breaks the SLO.
        for i in range(len(rungs)):
            if i not in passing:
                break
            slo_limit = i
        chosen = min(knee, slo_limit) if slo_limit is not None else None
    return {"throughput_knee": knee, "saturated": knee < len(rungs) - 1, "slo_passing": passing,
            "slo_limit": slo_limit, "recommended": chosen,
            "recommended_load": rungs[chosen]["load"] if chosen is not None else None,
            "recommendation": _recommendation(rungs, ladder, slo, knee, slo_limit, chosen, server_model,
                                              server_args)}


def plateau_start(throughput: list[float], candidates: Any, min_gain: float) -> int:
    """The first of `candidates` (indices) within `min_gain` of the best throughput among them: past
    it, more load (or a larger setting) buys less than `min_gain` more."""
    candidates = list(candidates)
    best = max(throughput[i] for i in candidates)
    return next(i for i in candidates if throughput[i] * (1 + min_gain) >= best)


def slo_violations(rung: dict[str, Any], slo: dict[str, float]) -> list[str]:
    """The limits a rung breaks (a failed request breaks any SLO)."""
    broken = [f"{key} {rung[key]:.0f} > {limit:.0f}" for key, limit in slo.items()
              if rung.get(key) is not None and rung[key] > limit]
    if rung["failed"]:
        broken.append(f"{rung['failed']} failed requests, e.g. {rung['errors'][0][:200]}")
    return broken


def _recommendation(rungs: list[dict[str, Any]], ladder: str, slo: dict[str, float], knee: int,
                    slo_limit: int | None, chosen: int | None, server_model: str | None, server_args: str) -> str:
    if chosen is None:
        worst = 0 if ladder != SETTINGS_LADDER else knee
        return (f"No rung meets the SLO ({'; '.join(slo_violations(rungs[worst], slo))} at {ladder} "
                f"{rungs[worst]['load']}): lower the load, or give the server more memory or compute "
                f"(see pagellm plan).")
    rung = rungs[chosen]
    load = rung["load"]
    why = []
    if ladder == SETTINGS_LADDER:
        why.append("the smallest setting within the SLO whose throughput is near the best within it")
    else:
        if chosen == knee and knee < len(rungs) - 1:
            why.append(f"more load buys little more throughput ({rungs[-1]['output_throughput']:.1f} tok/s at "
                       f"{rungs[-1]['load']})")
        if chosen == slo_limit and slo_limit < len(rungs) - 1:
            why.append(f"the next rung breaks the SLO ({'; '.join(slo_violations(rungs[slo_limit + 1], slo))})")
        if not why:
            why.append("the highest load tried; extend --values to find the knee")
    numbers = (f"{rung['request_throughput']:.2f} req/s, {rung['output_throughput']:.1f} output tok/s, "
               f"p99 TTFT {rung['p99_ttft_ms']:.0f} ms, p99 TPOT {_ms(rung['p99_tpot_ms'])}")
    if ladder == SETTINGS_LADDER:
        command = shlex.join(["pagellm", "serve", *([server_model] if server_model else []),
                              *shlex.split(server_args), "--max-num-seqs", str(load)])
        settings = f"run `{command}`"
    elif ladder == "max-concurrency":
        settings = (f"keep at most {load} requests in flight: `--max-num-seqs {load}` on the server caps its "
                    f"running batch there (the rest queue; bound the queue with --max-waiting-requests)")
    else:
        settings = f"admit at most {load} requests/s to this server as it ran (e.g. at the load balancer)"
    return f"Recommended: {ladder} {load} ({numbers}); {'; '.join(why)}. Settings: {settings}."


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def format_rungs(rungs: list[dict[str, Any]], ladder: str, analysis: dict[str, Any]) -> str:
    rows = []
    for i, r in enumerate(rungs):
        mark = " ".join(name for name, index in (("knee", analysis["throughput_knee"]),
                                                  ("recommended", analysis["recommended"])) if index == i)
        rows.append([r["load"], r["completed"], r["failed"], r["request_throughput"], r["output_throughput"],
                     r["p50_ttft_ms"], r["p99_ttft_ms"], r["p50_tpot_ms"] or "-", r["p99_tpot_ms"] or "-", mark])
    return format_table([ladder, "done", "failed", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99",
                         "TPOT p50 ms", "TPOT p99", ""], rows, left=(9,))
