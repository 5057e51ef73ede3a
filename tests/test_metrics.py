"""Prometheus and log-line stat loggers fed hand-built engine stats."""
from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagellm.core.outputs import LoRAStats, SchedulerStats
from pagellm.metrics.log_stats import CumulativeDelta, LoggingStatLogger
from pagellm.metrics.prometheus import PrometheusStatLogger, token_count_buckets
from pagellm.metrics.stats import FinishedRequestStats, IterationStats


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, frozenset], float]:
    """Every exposed sample keyed by (sample name, labels), parsed back from `render()`."""
    text = logger.render().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(parsed: dict, name: str, **labels: str) -> float:
    return parsed[(name, frozenset({"model_name": "tiny", "engine": "0", **labels}.items()))]


def finished(reason: str, e2e: float, queued: float, prompt: int, gen: int) -> FinishedRequestStats:
    return FinishedRequestStats(finish_reason=reason, e2e_latency=e2e, queued_time=queued,
                                num_prompt_tokens=prompt, num_generation_tokens=gen)


def test_prometheus_counters_gauges_and_cumulative_deltas():
    logger = PrometheusStatLogger("tiny")
    logger.record(
        SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25,
                       prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1),
        IterationStats(num_prompt_tokens=50, num_generation_tokens=3))
    logger.record(
        SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.5,
                       prefix_cache_queries=160, prefix_cache_hits=70, num_preemptions=1),
        IterationStats(num_prompt_tokens=10, num_generation_tokens=4))
    parsed = samples(logger)
    # Gauges hold the latest values, as fractions for the cache (like vLLM).
    assert value(parsed, "pagellm:num_requests_running") == 1
    assert value(parsed, "pagellm:num_requests_waiting") == 0
    assert value(parsed, "pagellm:kv_cache_usage_perc") == 0.5
    # Per-iteration increments add up.
    assert value(parsed, "pagellm:prompt_tokens_total") == 60
    assert value(parsed, "pagellm:generation_tokens_total") == 7
    # Running totals are not added twice: the counter ends at the latest total.
    assert value(parsed, "pagellm:prefix_cache_queries_total") == 160
    assert value(parsed, "pagellm:prefix_cache_hits_total") == 70
    assert value(parsed, "pagellm:num_preemptions_total") == 1


def test_prometheus_counter_keeps_growing_when_engine_total_restarts():
    logger = PrometheusStatLogger("tiny")
    logger.record(SchedulerStats(prefix_cache_queries=100, num_preemptions=5), IterationStats())
    # A fresh engine reports small totals again; its counts are new work, never a decrease.
    logger.record(SchedulerStats(prefix_cache_queries=30, num_preemptions=2), IterationStats())
    parsed = samples(logger)
    assert value(parsed, "pagellm:prefix_cache_queries_total") == 130
    assert value(parsed, "pagellm:num_preemptions_total") == 7


def test_prometheus_request_success_by_reason_and_histograms():
    logger = PrometheusStatLogger("tiny", max_model_len=1000)
    logger.record(SchedulerStats(), IterationStats(
        time_to_first_tokens=[0.02, 0.3], inter_token_latencies=[0.01, 0.02, 0.04],
        finished_requests=[finished("stop", 1.5, 0.1, 12, 7), finished("length", 3.0, 0.5, 8, 16)]))
    logger.record(SchedulerStats(), IterationStats(
        finished_requests=[finished("stop", 0.5, 0.0, 4, 1)]))
    parsed = samples(logger)

    assert value(parsed, "pagellm:request_success_total", finished_reason="stop") == 2
    assert value(parsed, "pagellm:request_success_total", finished_reason="length") == 1
    # Every reason's series exists before its first request, so dashboards see a 0, not a gap.
    assert value(parsed, "pagellm:request_success_total", finished_reason="abort") == 0

    def count_and_sum(name: str) -> tuple[float, float]:
        return value(parsed, f"{name}_count"), value(parsed, f"{name}_sum")

    assert count_and_sum("pagellm:time_to_first_token_seconds") == (2, pytest.approx(0.32))
    assert count_and_sum("pagellm:inter_token_latency_seconds") == (3, pytest.approx(0.07))
    assert count_and_sum("pagellm:e2e_request_latency_seconds") == (3, 5.0)
    assert count_and_sum("pagellm:request_queue_time_seconds") == (3, 0.6)
    assert count_and_sum("pagellm:request_prompt_tokens") == (3, 24)
    assert count_and_sum("pagellm:request_generation_tokens") == (3, 24)
    # Buckets are cumulative: prompts of 4 and 8 fit under 10, all three under 20.
    assert value(parsed, "pagellm:request_prompt_tokens_bucket", le="5.0") == 1
    assert value(parsed, "pagellm:request_prompt_tokens_bucket", le="10.0") == 2
    assert value(parsed, "pagellm:request_prompt_tokens_bucket", le="20.0") == 3
    assert value(parsed, "pagellm:request_prompt_tokens_bucket", le="+Inf") == 3
    assert value(parsed, "pagellm:time_to_first_token_seconds_bucket", le="0.025") == 1


def test_prometheus_exposed_names_and_separate_registries():
    first, second = PrometheusStatLogger("tiny"), PrometheusStatLogger("other")
    first.record(SchedulerStats(), IterationStats(num_prompt_tokens=5))
    assert value(samples(first), "pagellm:prompt_tokens_total") == 5
    # A second logger in the same process neither collides nor sees the first one's counts.
    assert samples(second)[("pagellm:prompt_tokens_total",
                            frozenset({"model_name": "other", "engine": "0"}.items()))] == 0
    names = {name for name, _ in samples(first)}
    expected = {
        "pagellm:num_requests_running", "pagellm:num_requests_waiting",
        "pagellm:kv_cache_usage_perc", "pagellm:prompt_tokens_total",
        "pagellm:generation_tokens_total", "pagellm:request_success_total",
        "pagellm:num_preemptions_total", "pagellm:prefix_cache_queries_total",
        "pagellm:prefix_cache_hits_total"}
    histograms = {"pagellm:time_to_first_token_seconds", "pagellm:inter_token_latency_seconds",
                  "pagellm:e2e_request_latency_seconds", "pagellm:request_queue_time_seconds",
                  "pagellm:request_prompt_tokens", "pagellm:request_generation_tokens"}
    expected |= {f"{h}_{suffix}" for h in histograms for suffix in ("bucket", "count", "sum")}
    assert expected <= names
    assert first.content_type.startswith("text/plain")


def test_prometheus_engines_of_data_parallel_replicas_have_their_own_series():
    logger = PrometheusStatLogger("tiny", num_engines=2)
    assert value(samples(logger), "pagellm:prefix_cache_hits_total", engine="1") == 0  # exists from the start
    logger.record(SchedulerStats(num_running_reqs=3, prefix_cache_hits=40), IterationStats(num_prompt_tokens=7), 0)
    logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_hits=10), IterationStats(num_prompt_tokens=2), 1)
    logger.record(SchedulerStats(num_running_reqs=2, prefix_cache_hits=45), IterationStats(), 0)
    parsed = samples(logger)
    # Each engine's running totals become increments on its own: 45 and 10, not 45 + 10 - 40.
    assert value(parsed, "pagellm:prefix_cache_hits_total", engine="0") == 45
    assert value(parsed, "pagellm:prefix_cache_hits_total", engine="1") == 10
    assert value(parsed, "pagellm:num_requests_running", engine="0") == 2
    assert value(parsed, "pagellm:num_requests_running", engine="1") == 1
    assert value(parsed, "pagellm:prompt_tokens_total", engine="1") == 2


def test_prometheus_lora_metrics_only_with_lora_and_one_info_series_per_engine():
    assert not any(name.startswith("pagellm:lora") for name, _ in samples(PrometheusStatLogger("tiny")))
    logger = PrometheusStatLogger("tiny", num_engines=2, max_loras=2)

    def info(parsed: dict, engine: str) -> list[tuple[str, str, str]]:
        series = [dict(labels) for name, labels in parsed if name == "pagellm:lora_requests_info"]
        return [(s["max_lora"], s["running_lora_adapters"], s["waiting_lora_adapters"])
                for s in series if s["engine"] == engine]

    assert info(samples(logger), "1") == [("2", "", "")]  # exists from the start, no adapter in use
    logger.record(SchedulerStats(lora=LoRAStats(running=["a", "b"], waiting=["c"], max_loras=2, num_loads=2)),
                  IterationStats())
    logger.record(SchedulerStats(lora=LoRAStats(running=["c"], max_loras=2, num_loads=3, num_evictions=1)),
                  IterationStats())
    parsed = samples(logger)
    # The adapters of engine 0 now, alone (the earlier set's series is gone); the value is a time.
    assert info(parsed, "0") == [("2", "c", "")]
    assert info(parsed, "1") == [("2", "", "")]
    assert value(parsed, "pagellm:lora_requests_info", max_lora="2", running_lora_adapters="c",
                 waiting_lora_adapters="") > 1e9
    assert value(parsed, "pagellm:lora_adapter_loads_total") == 3
    assert value(parsed, "pagellm:lora_adapter_evictions_total") == 1
    assert value(parsed, "pagellm:lora_adapter_loads_total", engine="1") == 0


def test_token_count_buckets_stop_at_max():
    assert token_count_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_count_buckets(4096)[-1] == 2000


def test_cumulative_delta():
    delta = CumulativeDelta()
    assert [delta.update(t) for t in (10, 10, 25, 4, 6)] == [10, 0, 15, 4, 2]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_log_line_once_per_interval_with_rates(caplog):
    clock = FakeClock()
    log = logging.getLogger("pagellm.metrics.test")
    stat_logger = LoggingStatLogger(interval_s=10.0, logger=log, clock=clock)
    caplog.set_level(logging.INFO, logger=log.name)

    clock.now += 4
    stat_logger.record(SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=20),
                       IterationStats(num_prompt_tokens=300, num_generation_tokens=10))
    clock.now += 5.9
    stat_logger.record(SchedulerStats(prefix_cache_queries=150, prefix_cache_hits=45),
                       IterationStats(num_prompt_tokens=100, num_generation_tokens=30))
    assert caplog.messages == []  # 9.9 s in: not yet

    clock.now += 0.1
    stat_logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.425,
                                      prefix_cache_queries=200, prefix_cache_hits=50),
                       IterationStats(num_prompt_tokens=100, num_generation_tokens=10))
    # 500 prompt and 50 generated tokens over 10 s; 50 hits of 200 queried tokens.
    assert caplog.messages == [
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 42.5%, Prefix cache hit rate: 25.0%"]

    # The next interval counts only what came after the line: 40 queries, 30 hits over 20 s.
    clock.now += 20
    stat_logger.record(SchedulerStats(num_running_reqs=1, prefix_cache_queries=240,
                                      prefix_cache_hits=80),
                       IterationStats(num_generation_tokens=100))
    assert caplog.messages[1] == (
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
        "Running: 1 reqs, Waiting: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 75.0%")


def test_log_line_without_prefix_queries_and_invalid_interval(caplog):
    clock = FakeClock()
    log = logging.getLogger("pagellm.metrics.test")
    caplog.set_level(logging.INFO, logger=log.name)
    stat_logger = LoggingStatLogger(interval_s=1.0, logger=log, clock=clock)
    clock.now += 2
    stat_logger.record(SchedulerStats(), IterationStats(num_generation_tokens=8))
    assert caplog.messages[0].endswith("Prefix cache hit rate: 0.0%")
    assert "Avg generation throughput: 4.0 tokens/s" in caplog.messages[0]
    with pytest.raises(ValueError, match="interval_s"):
        LoggingStatLogger(interval_s=0)
