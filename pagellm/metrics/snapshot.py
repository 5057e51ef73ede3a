"""The JSON form of the server's Prometheus metrics (`/stats`): the same counters, read from the registry.

Totals since start-up, summed over the engines (data-parallel replicas); a client turns two snapshots
into rates (tokens/s, hit rate) and windowed percentiles (histogram buckets' differences).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from prometheus_client import CollectorRegistry

from pagellm.metrics.prometheus import FINISH_REASONS, TURNED_AWAY_REASONS, PrometheusStatLogger

HISTOGRAMS = {"ttft": "pagellm:time_to_first_token_seconds", "itl": "pagellm:inter_token_latency_seconds",
              "e2e": "pagellm:e2e_request_latency_seconds", "queue": "pagellm:request_queue_time_seconds"}
"""The latency histograms the snapshot carries, by their short name there."""
_LABELS = ("finished_reason", "reason", "le")
"""The labels a sample's key keeps (model_name and engine are summed over)."""


def _totals(registry: CollectorRegistry) -> dict[str, float]:
    """`name` or `name{label}` -> the sum over engines of every sample in the registry."""
    totals: dict[str, float] = defaultdict(float)
    for family in registry.collect():
        for sample in family.samples:
            label = next((sample.labels[key] for key in _LABELS if key in sample.labels), None)
            totals[f"{sample.name}{{{label}}}" if label is not None else sample.name] += sample.value
    return totals


def _histogram(totals: dict[str, float], name: str) -> dict[str, Any]:
    prefix = f"{name}_bucket{{"
    buckets = sorted((float(key[len(prefix):-1]), value) for key, value in totals.items() if key.startswith(prefix))
    return {"le": [bound for bound, _ in buckets if bound != float("inf")],
            "cumulative": [int(value) for _, value in buckets],  # the last one is +Inf: the count
            "count": int(totals[f"{name}_count"]), "sum": totals[f"{name}_sum"]}


def metrics_snapshot(metrics: PrometheusStatLogger) -> dict[str, Any]:
    """The metrics' state as JSON-ready values; gauges of several engines are summed (KV usage averaged)."""
    t = _totals(metrics.registry)

    def n(key: str) -> int:  # a count: exact in a float
        return int(t[key])

    return {
        "time": time.time(),
        "requests": {
            "running": n("pagellm:num_requests_running"), "waiting": n("pagellm:num_requests_waiting"),
            "finished": {reason: n(f"pagellm:request_success_total{{{reason}}}") for reason in FINISH_REASONS},
            "turned_away": {reason: n(f"pagellm:http_requests_turned_away_total{{{reason}}}")
                            for reason in TURNED_AWAY_REASONS},
        },
        "kv_cache_usage": t["pagellm:kv_cache_usage_perc"] / metrics.num_engines,
        "tokens": {"prompt": n("pagellm:prompt_tokens_total"), "generation": n("pagellm:generation_tokens_total")},
        "prefix_cache": {"queries": n("pagellm:prefix_cache_queries_total"),
                         "hits": n("pagellm:prefix_cache_hits_total")},
        "preemptions": n("pagellm:num_preemptions_total"),
        "latency": {short: _histogram(t, name) for short, name in HISTOGRAMS.items()},
    }
