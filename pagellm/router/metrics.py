"""The router's Prometheus metrics (prefix `pagellm:router_`), in a registry of its own."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class RouterMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("pagellm:router_requests", "Requests answered by a backend, by status code",
                                ["model", "backend", "code"], registry=r)
        self.errors = Counter("pagellm:router_backend_errors", "Backend failures: connect errors, timeouts, 5xx, "
                              "broken streams", ["model", "backend", "kind"], registry=r)
        self.latency = Histogram("pagellm:router_request_latency_seconds", "Request latency through the router "
                                 "(to the last byte)", ["model", "backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram("pagellm:router_time_to_first_byte_seconds", "Time to the backend's first "
                                    "response byte", ["model", "backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.failovers = Counter("pagellm:router_failovers", "Requests retried on another backend after this one "
                                 "failed before the first byte", ["model", "backend"], registry=r)
        self.cache = Counter("pagellm:router_cache_lookups", "Response-cache lookups by result (hit, miss)",
                             ["model", "result"], registry=r)
        self.throttled = Counter("pagellm:router_throttled", "Requests refused with 429, by key and limit",
                                 ["key", "limit"], registry=r)
        self.truncations = Counter("pagellm:router_truncations", "Prompts truncated under a length policy",
                                   ["model", "policy"], registry=r)
        self.rejections = Counter("pagellm:router_length_rejections", "Requests refused over a length limit",
                                  ["model"], registry=r)
        self.in_flight = Gauge("pagellm:router_backend_in_flight", "Requests in flight per backend", ["backend"],
                               registry=r)
        self.pd_requests = Counter("pagellm:router_pd_requests", "Disaggregated requests by outcome: transferred "
                                   "(sent to decode with the prefill's KV) or fallback (decode prefilled itself)",
                                   ["outcome"], registry=r)
        self.pd_fallbacks = Counter("pagellm:router_pd_fallbacks", "Disaggregated requests sent to decode "
                                    "without KV, by reason (prefill_unavailable, prefill_error, "
                                    "no_kv_transfer_params, n_above_1)",
                                    ["reason"], registry=r)
        self.pd_prefill_latency = Histogram("pagellm:router_pd_prefill_seconds", "Prefill round trip of a "
                                            "disaggregated request (sent to the prefill pool until its answer)",
                                            ["backend"], buckets=LATENCY_BUCKETS, registry=r)
        self.healthy = Gauge("pagellm:router_backend_healthy", "1 while the backend is in rotation", ["backend"],
                             registry=r)
