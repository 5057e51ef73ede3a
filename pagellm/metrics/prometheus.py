"""Prometheus metrics under the names vLLM users already chart, with the `pagellm:` prefix."""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagellm.core.outputs import LoRAStats, SchedulerStats, SpecDecodeStats
from pagellm.metrics.log_stats import CumulativeDelta
from pagellm.metrics.stats import IterationStats

FINISH_REASONS = ("stop", "length", "abort")
"""Created up front so every reason's series exists (at 0) before its first request ends."""
TURNED_AWAY_REASONS = ("at_capacity", "queue_timeout", "draining", "timed_out")
"""Why the server answered a generation request without running it to its end (503, 503, 503, 504)."""

# Seconds. First tokens range from a few ms (short cached prompt on a GPU) to minutes (long
# prompts queued behind others on a CPU); token gaps are usually tens of ms; whole requests can
# run for hours in batch jobs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                       1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

MM_PREPARE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds: a data URL of a small image prepares in milliseconds, a slow URL takes up to its timeout."""


def token_count_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: even resolution per decade of lengths."""
    buckets: list[float] = []
    magnitude = 1
    while True:
        for step in (1, 2, 5):
            value = step * magnitude
            if value > max_value:
                return tuple(buckets)
            buckets.append(float(value))
        magnitude *= 10


class PrometheusStatLogger:
    """Records every iteration's stats into Prometheus metrics labelled with `model_name`.

    Each logger owns a fresh `CollectorRegistry` unless one is given, so tests and several
    engines in one process never collide on metric names in the global registry.
    """

    content_type = CONTENT_TYPE_LATEST
    """The Content-Type header for `render()`'s bytes."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 max_model_len: int = 131072, num_engines: int = 1, max_loras: int | None = None) -> None:
        """`max_model_len` bounds the token-count histograms' buckets. Metrics of the engine carry
        an `engine` label (the data-parallel replica, "0" to `num_engines - 1`). `max_loras`: the
        engine's (--max-loras) when it serves LoRA adapters, which adds their metrics."""
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self.model_name = model_name
        self.num_engines = num_engines
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            # prometheus_client appends `_total` on exposition, so the name here goes without it.
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

        self.num_requests_running = gauge("pagellm:num_requests_running",
                                          "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("pagellm:num_requests_waiting",
                                          "Number of requests waiting to be scheduled.")
        self.num_requests_waiting_by_priority = Gauge(
            "pagellm:num_requests_waiting_by_priority",
            "Number of requests waiting to be scheduled, per priority (only priorities with waiting requests: a "
            "series goes when its last request is scheduled or aborted).",
            labels + ["priority"], registry=self.registry)
        self._waiting_priorities: list[set[int]] = [set() for _ in range(num_engines)]
        """Per engine, the priorities whose series exist."""
        self.kv_cache_usage = gauge("pagellm:kv_cache_usage_perc",
                                    "Fraction of KV-cache blocks in use (0 to 1).")

        self.prompt_tokens = counter("pagellm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("pagellm:generation_tokens",
                                         "Number of generation tokens processed.")
        self.num_preemptions = counter("pagellm:num_preemptions",
                                       "Cumulative number of preemptions by the scheduler.")
        self.prefix_cache_queries = counter("pagellm:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("pagellm:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.spec_decode_num_drafts = counter("pagellm:spec_decode_num_drafts",
                                              "Speculative decoding: request steps that verified draft tokens.")
        self.spec_decode_num_draft_tokens = counter("pagellm:spec_decode_num_draft_tokens",
                                                    "Speculative decoding: draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("pagellm:spec_decode_num_accepted_tokens",
                                                       "Speculative decoding: draft tokens accepted.")
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            "pagellm:spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each position of the drafts (0-based).",
            labels + ["position"], registry=self.registry)
        self.kv_offload = {
            "host_hit_tokens": counter("pagellm:kv_offload_hit_tokens",
                                       "Prompt tokens loaded from the host KV tier instead of computed."),
            "bytes_to_host": counter("pagellm:kv_offload_bytes_to_host",
                                     "Bytes of KV blocks copied from the device to the host tier (driver rank)."),
            "bytes_to_device": counter("pagellm:kv_offload_bytes_to_device",
                                       "Bytes of KV blocks copied from the host tier to the device (driver rank)."),
            "swaps_out": counter("pagellm:kv_offload_swaps_out", "Preempted requests whose blocks were swapped out."),
            "swaps_in": counter("pagellm:kv_offload_swaps_in", "Swapped-out requests resumed from the host tier."),
            "failed_loads": counter("pagellm:kv_offload_failed_loads",
                                    "Requests recomputed because the KV connector failed to load their blocks."),
            # Disaggregated prefill/decode (NixlConnector), on both sides.
            "transfers": counter("pagellm:kv_transfer_count",
                                 "Remote KV transfers completed: pulls (decode engine), prompts pulled or expired "
                                 "(prefill engine)."),
            "transfer_bytes": counter("pagellm:kv_transfer_bytes", "Bytes of KV pulled from prefill engines."),
            "transfer_seconds": counter("pagellm:kv_transfer_seconds",
                                        "Seconds pulls took, summed (to the step that saw them end)."),
            "transfer_failures": counter("pagellm:kv_transfer_failures",
                                         "Remote KV pulls refused or failed: the decode engine recomputed the prompt."),
            "remote_hit_tokens": counter("pagellm:kv_transfer_hit_tokens",
                                         "Prompt tokens pulled from a prefill engine instead of computed."),
        }
        self.kv_transfer_held_requests = gauge(
            "pagellm:kv_transfer_held_requests",
            "Requests whose KV blocks are held for a transfer: finished prompts waiting for a pull (prefill "
            "engine), requests waiting for their pull (decode engine).")
        self._kv_offload_deltas = [{key: CumulativeDelta() for key in self.kv_offload} for _ in range(num_engines)]
        self.request_success = Counter("pagellm:request_success", "Count of finished requests.",
                                       labels + ["finished_reason"], registry=self.registry)

        # Its series appear at ready (`record_startup`): the phases are known only then.
        self.startup_seconds = Gauge("pagellm:startup_seconds",
                                     "Seconds each start-up phase took, and their total (phase=total).",
                                     ["model_name", "phase"], registry=self.registry)
        self.http_turned_away = Counter(
            "pagellm:http_requests_turned_away",
            "Generation requests answered 503 (at capacity, past their queue time, draining) or 504 (past their "
            "time limit).",
            ["model_name", "reason"], registry=self.registry)
        for reason in TURNED_AWAY_REASONS:
            self.http_turned_away.labels(model_name, reason)

        self.mm_images = Counter("pagellm:mm_images", "Images of chat requests fetched, decoded and prepared by the "
                                 "model's processor.", ["model_name"], registry=self.registry)
        self.mm_images.labels(model_name)
        self.mm_encoder_images = counter("pagellm:mm_encoder_images", "Images the vision encoder ran on.")
        self.mm_encoder_seconds = counter("pagellm:mm_encoder_seconds", "Seconds the vision encoder took.")
        self.mm_prepare_time = Histogram("pagellm:mm_prepare_seconds",
                                         "Seconds to fetch, decode and prepare one request's images.", ["model_name"],
                                         buckets=MM_PREPARE_BUCKETS, registry=self.registry)
        self.mm_prepare_time.labels(model_name)

        self.time_to_first_token = histogram("pagellm:time_to_first_token_seconds",
                                             "Time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("pagellm:inter_token_latency_seconds",
                                             "Time between consecutive output tokens in seconds.",
                                             INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = histogram("pagellm:e2e_request_latency_seconds",
                                             "End-to-end request latency in seconds.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("pagellm:request_queue_time_seconds",
                                            "Time requests spent waiting before first scheduled.",
                                            REQUEST_LATENCY_BUCKETS)
        token_buckets = token_count_buckets(max_model_len)
        self.request_prompt_tokens = histogram("pagellm:request_prompt_tokens",
                                               "Prompt length of finished requests in tokens.",
                                               token_buckets)
        self.request_generation_tokens = histogram(
            "pagellm:request_generation_tokens",
            "Generated length of finished requests in tokens.", token_buckets)

        # Totals since each engine started, turned into increments per engine.
        self._deltas = [(CumulativeDelta(), CumulativeDelta(), CumulativeDelta()) for _ in range(num_engines)]
        self._spec_deltas: list[dict[str, CumulativeDelta]] = [{} for _ in range(num_engines)]
        self._encoder_deltas = [(CumulativeDelta(), CumulativeDelta()) for _ in range(num_engines)]
        self._lora = None if max_loras is None else _LoRAMetrics(self.registry, model_name, num_engines, max_loras)
        for engine in range(num_engines):  # every series exists from the start, at zero
            for family in (self.num_requests_running, self.num_requests_waiting, self.kv_cache_usage,
                           self.prompt_tokens, self.generation_tokens, self.num_preemptions,
                           self.prefix_cache_queries, self.prefix_cache_hits, self.spec_decode_num_drafts,
                           self.mm_encoder_images, self.mm_encoder_seconds,
                           self.spec_decode_num_draft_tokens, self.spec_decode_num_accepted_tokens,
                           self.time_to_first_token,
                           self.inter_token_latency, self.e2e_request_latency, self.request_queue_time,
                           self.request_prompt_tokens, self.request_generation_tokens):
                family.labels(model_name, str(engine))
            for reason in FINISH_REASONS:
                self.request_success.labels(model_name, str(engine), reason)
        for reason in TURNED_AWAY_REASONS:
            self.http_turned_away.labels(model_name, reason)

    def _record_waiting_by_priority(self, counts: dict[int, int], labels: tuple[str, str], engine_index: int) -> None:
        # Priorities are the clients' integers: a series per priority ever seen would grow without
        # bound, so the series of a priority nobody waits at any more is removed.
        seen = self._waiting_priorities[engine_index]
        for priority in seen - counts.keys():
            self.num_requests_waiting_by_priority.remove(*labels, str(priority))
        for priority, n in counts.items():
            self.num_requests_waiting_by_priority.labels(*labels, str(priority)).set(n)
        self._waiting_priorities[engine_index] = set(counts)

    def _record_spec(self, spec: SpecDecodeStats, labels: tuple[str, str], deltas: dict[str, CumulativeDelta]) -> None:
        totals = {"drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
                  "accepted": spec.num_accepted_tokens,
                  **{f"pos{i}": n for i, n in enumerate(spec.accepted_per_position)}}
        increments = {key: deltas.setdefault(key, CumulativeDelta()).update(total) for key, total in totals.items()}
        self.spec_decode_num_drafts.labels(*labels).inc(increments["drafts"])
        self.spec_decode_num_draft_tokens.labels(*labels).inc(increments["draft_tokens"])
        self.spec_decode_num_accepted_tokens.labels(*labels).inc(increments["accepted"])
        for i in range(len(spec.accepted_per_position)):
            self.spec_decode_num_accepted_tokens_per_pos.labels(*labels, str(i)).inc(increments[f"pos{i}"])

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats, engine_index: int = 0) -> None:
        labels = (self.model_name, str(engine_index))
        self.num_requests_running.labels(*labels).set(scheduler_stats.num_running_reqs)
        self.num_requests_waiting.labels(*labels).set(scheduler_stats.num_waiting_reqs)
        self._record_waiting_by_priority(scheduler_stats.num_waiting_by_priority, labels, engine_index)
        self.kv_cache_usage.labels(*labels).set(scheduler_stats.kv_cache_usage)

        # These arrive as totals since the engine started; Prometheus counters want increments.
        preemptions, prefix_queries, prefix_hits = self._deltas[engine_index]
        self.num_preemptions.labels(*labels).inc(preemptions.update(scheduler_stats.num_preemptions))
        self.prefix_cache_queries.labels(*labels).inc(prefix_queries.update(scheduler_stats.prefix_cache_queries))
        self.prefix_cache_hits.labels(*labels).inc(prefix_hits.update(scheduler_stats.prefix_cache_hits))
        encoder_images, encoder_seconds = self._encoder_deltas[engine_index]
        self.mm_encoder_images.labels(*labels).inc(encoder_images.update(scheduler_stats.mm_encoder_images))
        self.mm_encoder_seconds.labels(*labels).inc(encoder_seconds.update(scheduler_stats.mm_encoder_seconds))
        if scheduler_stats.spec is not None:
            self._record_spec(scheduler_stats.spec, labels, self._spec_deltas[engine_index])
        if scheduler_stats.kv_transfer is not None:
            deltas = self._kv_offload_deltas[engine_index]
            for key, family in self.kv_offload.items():
                family.labels(*labels).inc(deltas[key].update(getattr(scheduler_stats.kv_transfer, key)))
            self.kv_transfer_held_requests.labels(*labels).set(scheduler_stats.kv_transfer.held_requests)
        if scheduler_stats.lora is not None and self._lora is not None:
            self._lora.record(scheduler_stats.lora, engine_index)

        self.prompt_tokens.labels(*labels).inc(iteration_stats.num_prompt_tokens)
        self.generation_tokens.labels(*labels).inc(iteration_stats.num_generation_tokens)
        for ttft in iteration_stats.time_to_first_tokens:
            self.time_to_first_token.labels(*labels).observe(ttft)
        for itl in iteration_stats.inter_token_latencies:
            self.inter_token_latency.labels(*labels).observe(itl)
        for finished in iteration_stats.finished_requests:
            self.request_success.labels(*labels, finished.finish_reason).inc()
            self.e2e_request_latency.labels(*labels).observe(finished.e2e_latency)
            self.request_queue_time.labels(*labels).observe(finished.queued_time)
            self.request_prompt_tokens.labels(*labels).observe(finished.num_prompt_tokens)
            self.request_generation_tokens.labels(*labels).observe(finished.num_generation_tokens)

    def watch_admission(self, seqs: Callable[[], float], tokens: Callable[[], float],
                        waiting: Callable[[], float]) -> None:
        """Gauges of the server's admission by work, read at each scrape: the sequences and tokens
        admitted to the engine, and the requests waiting for room."""
        for name, doc, read in (
                ("pagellm:admitted_sequences", "Sequences of generation requests admitted to the engine.", seqs),
                ("pagellm:admitted_tokens", "Tokens (prompt + max_tokens) of the sequences admitted.", tokens),
                ("pagellm:requests_waiting_for_admission", "Generation requests waiting for room.", waiting)):
            Gauge(name, doc, ["model_name"], registry=self.registry).labels(self.model_name).set_function(read)

    def record_startup(self, phases: dict[str, float]) -> None:
        """The server's start-up phases (`pagellm.metrics.startup`, `total` among them), at ready."""
        for phase, seconds in phases.items():
            self.startup_seconds.labels(self.model_name, phase).set(seconds)

    def record_turned_away(self, reason: str) -> None:
        """One generation request the server's edge answered without running it to its end."""
        if reason not in TURNED_AWAY_REASONS:
            raise ValueError(f"reason must be one of {', '.join(TURNED_AWAY_REASONS)}, got {reason!r}")
        self.http_turned_away.labels(self.model_name, reason).inc()

    def record_images(self, count: int, seconds: float) -> None:
        """One request's `count` images, fetched, decoded and prepared in `seconds`."""
        self.mm_images.labels(self.model_name).inc(count)
        self.mm_prepare_time.labels(self.model_name).observe(seconds)

    def render(self) -> bytes:
        """The registry's current state in the Prometheus text exposition format."""
        return generate_latest(self.registry)


class _LoRAMetrics:
    """vLLM's `lora_requests_info`, and the host store's loads and evictions of adapters."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_engines: int, max_loras: int) -> None:
        labels = ["model_name", "engine"]
        self.model_name, self.max_loras = model_name, str(max_loras)
        self.requests_info = Gauge(
            "pagellm:lora_requests_info",
            "LoRA adapters of the running and of the waiting requests (comma-separated names) and max_lora; "
            "the value is the Unix time they were last reported.",
            [*labels, "max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry)
        self.adapter_loads = Counter("pagellm:lora_adapter_loads",
                                     "LoRA adapters loaded into host memory (again after an eviction too).",
                                     labels, registry=registry)
        self.adapter_evictions = Counter("pagellm:lora_adapter_evictions",
                                         "LoRA adapters dropped from host memory to make room (--max-cpu-loras).",
                                         labels, registry=registry)
        self._deltas = [(CumulativeDelta(), CumulativeDelta()) for _ in range(num_engines)]
        self._info_labels: list[tuple[str, ...]] = []
        for engine in range(num_engines):  # every series exists from the start: no adapter in use
            self._info_labels.append((model_name, str(engine), self.max_loras, "", ""))
            self.requests_info.labels(*self._info_labels[engine]).set_to_current_time()
            self.adapter_loads.labels(model_name, str(engine))
            self.adapter_evictions.labels(model_name, str(engine))

    def record(self, stats: LoRAStats, engine_index: int) -> None:
        engine = str(engine_index)
        loads, evictions = self._deltas[engine_index]
        self.adapter_loads.labels(self.model_name, engine).inc(loads.update(stats.num_loads))
        self.adapter_evictions.labels(self.model_name, engine).inc(evictions.update(stats.num_evictions))
        info = (self.model_name, engine, self.max_loras, ",".join(stats.waiting), ",".join(stats.running))
        # One series per engine, for its adapters now: the ones of earlier sets would pile up (a
        # series for every combination of adapters ever seen) and look current to a plain query.
        if info != self._info_labels[engine_index]:
            self.requests_info.remove(*self._info_labels[engine_index])
            self._info_labels[engine_index] = info
        self.requests_info.labels(*info).set_to_current_time()
