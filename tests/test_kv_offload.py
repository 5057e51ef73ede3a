"""The KV connector seam and its host tier on the CPU (a tiny random Llama, a small device pool and a
host pool, both in CPU memory, the copies real): outputs against the tier off, swap preemption,
a failing connector, and the flags' errors."""
from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch
from engine_utils import TINY_LLAMA, assert_no_leak, wait_for

from benchmarks import kv_offload as kv_offload_bench
from pagellm import LLM, SamplingParams
from pagellm.cli import main as cli_main
from pagellm.config.kv_transfer import register_kv_connector
from pagellm.core.kv_connector import KVConnectorOutput, KVTransferStats
from pagellm.core.kv_offload import HostBlockIndex, OffloadMetadata
from pagellm.core.outputs import SchedulerStats
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.metrics.log_stats import LoggingStatLogger
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.metrics.stats import IterationStats
from pagellm.worker import kv_offload
from pagellm.worker.kv_offload import OffloadingWorker

BLOCK = 16
HOST_GIB = 0.01
"""About 160 blocks of the two-layer tiny Llama's KV: room for every prompt below."""


class FailingLoadWorker(OffloadingWorker):
    """Loads garbage into the destination blocks and says so, as a connector whose store went away."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failed: set[int] = set()

    def _load(self, host_slots: Sequence[int], block_ids: Sequence[int]) -> None:
        garbage = torch.randint(0, 255, (len(block_ids), *self.host.shape[1:]), dtype=torch.uint8, device=self.device)
        self._scatter(garbage, block_ids)
        self.failed.update(block_ids)

    def get_finished(self) -> KVConnectorOutput | None:
        report = super().get_finished() or KVConnectorOutput()
        report.failed_block_ids, self.failed = self.failed, set()
        return report


register_kv_connector("TestFailingLoads", "pagellm.core.kv_offload:OffloadingScheduler", FailingLoadWorker,
                      override=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-2l")
    (folder / "config.json").write_text(json.dumps(dict(TINY_LLAMA, num_hidden_layers=2)))
    return str(folder)


def engine(model_dir: str, num_blocks: int, **kwargs) -> LLM:
    return LLM(model_dir, load_format="dummy", device="cpu", dtype="float32", max_model_len=256,
               num_gpu_blocks_override=num_blocks, block_size=BLOCK, **kwargs)


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_tokens_same_with_host_tier_and_swap_under_preemption(model_dir, async_scheduling):
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": tokens(rng, 40 + 9 * i)} for i in range(8)]
    prompts += prompts  # the second round finds the first's prefixes evicted to the host
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs, stats = {}, {}
    for mode, kwargs in [("off", {}), ("host", {"kv_offloading_size": HOST_GIB}),
                         ("swap", {"kv_offloading_size": HOST_GIB, "preemption_mode": "swap"})]:
        llm = engine(model_dir, 24, async_scheduling=async_scheduling, **kwargs)
        outputs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats[mode] = llm.llm_engine.get_stats()
        assert_no_leak(llm.llm_engine)
        assert stats[mode].num_preemptions > 0, mode  # the running set does not fit the device pool
    assert outputs["host"] == outputs["off"]
    assert outputs["swap"] == outputs["off"]
    assert stats["off"].kv_transfer is None
    host = stats["host"].kv_transfer
    assert host.host_hit_tokens > 0 and host.bytes_to_host > 0 and host.bytes_to_device > 0
    assert host.swaps_out == 0
    swap = stats["swap"].kv_transfer
    assert swap.swaps_out > 0 and swap.swaps_in > 0
    # Resumed from the host, a swapped request computes less than recomputation does.
    assert stats["swap"].num_scheduled_tokens_total < stats["host"].num_scheduled_tokens_total


def _evicted_prefix_run(llm: LLM, prefix: list[int], suffix: list[int], rng: random.Random):
    """Run prefix + one suffix, evict the prefix from the device pool with other prompts, then run
    prefix + `suffix` with logprobs; returns that output and the stats before and after it."""
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate({"prompt_token_ids": prefix + tokens(rng, 10)}, greedy, use_tqdm=False)
    for _ in range(3):
        llm.generate({"prompt_token_ids": tokens(rng, 150)}, greedy, use_tqdm=False)
    before = llm.llm_engine.get_stats()
    out = llm.generate({"prompt_token_ids": prefix + suffix},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5), use_tqdm=False)
    return out[0].outputs[0], before, llm.llm_engine.get_stats()


def _assert_same(output, reference) -> None:
    assert output.token_ids == reference.token_ids
    for got, want in zip(output.logprobs, reference.logprobs):
        assert got.keys() == want.keys()
        for token_id, lp in want.items():
            assert abs(got[token_id].logprob - lp.logprob) <= 1e-5


def test_evicted_prefix_is_served_from_the_host_tier(model_dir):
    rng = random.Random(1)
    prefix, suffix = tokens(rng, 6 * BLOCK), tokens(rng, 10)
    llm = engine(model_dir, 16, kv_offloading_size=HOST_GIB)
    output, before, after = _evicted_prefix_run(llm, prefix, suffix, rng)
    assert after.prefix_cache_hits == before.prefix_cache_hits  # gone from the device
    assert after.kv_transfer.host_hit_tokens - before.kv_transfer.host_hit_tokens == len(prefix)
    fresh = engine(model_dir, 16, enable_prefix_caching=False).generate(
        {"prompt_token_ids": prefix + suffix},
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5), use_tqdm=False)
    _assert_same(output, fresh[0].outputs[0])
    assert_no_leak(llm.llm_engine)


def test_a_failed_load_recomputes(model_dir):
    rng = random.Random(2)
    prefix, suffix = tokens(rng, 6 * BLOCK), tokens(rng, 10)
    config = {"kv_connector": "TestFailingLoads", "kv_connector_extra_config": {"cpu_bytes_to_use": 8 << 20}}
    llm = engine(model_dir, 16, kv_transfer_config=json.dumps(config))
    output, before, after = _evicted_prefix_run(llm, prefix, suffix, rng)
    fresh = engine(model_dir, 16, enable_prefix_caching=False).generate(
        {"prompt_token_ids": prefix + suffix},
        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=5), use_tqdm=False)
    _assert_same(output, fresh[0].outputs[0])
    assert after.kv_transfer.failed_loads - before.kv_transfer.failed_loads == 1
    assert_no_leak(llm.llm_engine)


def test_host_index_evicts_least_recently_used_and_keeps_the_steps_slots():
    index = HostBlockIndex(2)
    a, b = index.insert("a", set()), index.insert("b", set())
    index.take("a")  # "b" is now the least recently used
    assert index.insert("c", set()) == b and "b" not in index
    assert index.insert("d", {a, b}) is None  # both slots busy this step
    index.drop("a")
    assert index.insert("e", set()) == a and len(index) == 2


@pytest.mark.parametrize("kwargs, flag", [
    ({"kv_offloading_size": 1e9}, "--kv-offloading-size"),
    ({"swap_space": 1e9}, "--swap-space"),
    ({"kv_offloading_size": -1}, "--kv-offloading-size"),
    ({"kv_transfer_config": '{"kv_connector": "NoSuchConnector"}'}, "--kv-transfer-config"),
    ({"kv_transfer_config": '{"kv_connector": '}, "--kv-transfer-config"),
    ({"kv_transfer_config": '{"kv_connector": "OffloadingConnector", "kv_rol": "kv_both"}'}, "--kv-transfer-config"),
    ({"preemption_mode": "swap"}, "--preemption-mode"),
    ({"preemption_mode": "evict", "kv_offloading_size": 1}, "--preemption-mode"),
])
def test_bad_flags_name_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        EngineArgs(**kwargs).validate()


def test_log_line_and_metrics_show_the_host_tier(caplog):
    clock = [1000.0]
    log = logging.getLogger("pagellm.metrics.kv_offload_test")
    caplog.set_level(logging.INFO, logger=log.name)
    stat_logger = LoggingStatLogger(interval_s=10.0, logger=log, clock=lambda: clock[0])
    metrics = PrometheusStatLogger("m", max_model_len=256)
    stats = SchedulerStats(prefix_cache_queries=100, prefix_cache_hits=20,
                           kv_transfer=KVTransferStats(host_hit_tokens=10, bytes_to_host=4096, swaps_out=1))
    metrics.record(stats, IterationStats())
    clock[0] += 10
    stats = SchedulerStats(prefix_cache_queries=200, prefix_cache_hits=50,
                           kv_transfer=KVTransferStats(host_hit_tokens=60, bytes_to_host=8192, swaps_out=1))
    stat_logger.record(stats, IterationStats())
    metrics.record(stats, IterationStats())
    assert caplog.messages[0].endswith("Prefix cache hit rate: 25.0%, Host KV hit rate: 30.0%")  # 60 of 200
    text = metrics.render().decode()
    assert 'pagellm:kv_offload_hit_tokens_total{engine="0",model_name="m"} 60.0' in text
    assert 'pagellm:kv_offload_bytes_to_host_total{engine="0",model_name="m"} 8192.0' in text
    assert 'pagellm:kv_offload_swaps_out_total{engine="0",model_name="m"} 1.0' in text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_worker_copies_blocks_out_and_back_in_chunks(monkeypatch, dtype):
    monkeypatch.setattr(kv_offload, "STAGING_BLOCKS", 3)  # several chunks, one run of slots split
    shape = (12, BLOCK, 2, 8)
    caches = [tuple(torch.randn(shape).to(dtype) for _ in range(2)) for _ in range(2)]
    original = [t.clone() for pair in caches for t in pair]
    config = SimpleNamespace(kv_transfer=SimpleNamespace(host_bytes=10 * 4 * BLOCK * 2 * 8 * dtype.itemsize))
    worker = kv_offload.OffloadingWorker(config, caches)
    assert worker.num_host_blocks == 10
    saved, slots = [7, 1, 2, 9, 4, 0, 11], [0, 1, 2, 3, 8, 9, 5]
    # Block 0 is saved and, in the same step, loaded into: the save must see its old bytes.
    worker.start_load_kv(OffloadMetadata(save_device=saved, save_host=slots, load_host=[6], load_device=[0]))
    report = worker.get_finished()
    assert (report.bytes_to_host, report.bytes_to_device) == (7 * worker.block_bytes, worker.block_bytes)
    targets = [3, 5, 6, 8, 10, 0, 2]
    worker.start_load_kv(OffloadMetadata(load_host=slots, load_device=targets))
    tensors = [t for pair in caches for t in pair]
    for got, want in zip(tensors, original):
        assert torch.equal(got[targets].view(torch.uint8), want[saved].view(torch.uint8))


@pytest.mark.slow  # two rank processes over gloo, each starting Python and importing torch
def test_tensor_parallel_ranks_copy_their_own_shards(model_dir):
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": tokens(rng, 40 + 9 * i)} for i in range(6)] * 2
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # Dummy weights are drawn per shard: the reference is the same split without the host tier.
    reference = [o.outputs[0].token_ids for o in engine(model_dir, 24, tensor_parallel_size=2).generate(
        prompts, params, use_tqdm=False)]
    llm = engine(model_dir, 24, tensor_parallel_size=2, kv_offloading_size=HOST_GIB, preemption_mode="swap")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.llm_engine.get_stats()
    assert got == reference
    assert stats.num_preemptions > 0 and stats.kv_transfer.swaps_in > 0 and stats.kv_transfer.host_hit_tokens > 0


@pytest.mark.slow  # five SmolLM2 engines on the CPU, each in a process of its own: about 35 s
def test_benchmark_smoke_runs_every_phase():
    payload = kv_offload_bench.main(["--model", "", "--load-format", "auto", "--smoke"])
    assert all(record["status"] == "ok" for record in payload["phases"].values()), payload["phases"]
    results = payload["results"]
    assert results["multi_turn_with_host"]["host_hit_rate"] > 0
    assert results["preemption_swap"]["swaps_in"] > 0 and results["preemption_recompute"]["num_preemptions"] > 0
    assert results["copy_bandwidth"]["bytes"] > 0


def test_plan_counts_the_host_tier_and_its_staging(capsys):
    def plan(*extra: str) -> dict:
        assert cli_main(["plan", "llama-3.1-8b", "--gpu-memory-gib", "80", "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    without, with_host = plan(), plan("--kv-offloading-size", "64")
    block = with_host["kv_bytes_per_block"]
    assert with_host["staging_bytes"] == 2 * kv_offload.STAGING_BLOCKS * block and without["staging_bytes"] == 0
    assert without["num_kv_blocks"] - with_host["num_kv_blocks"] == pytest.approx(2 * kv_offload.STAGING_BLOCKS, abs=1)
    assert with_host["host_kv_tokens"] == (64 << 30) // block * BLOCK
    assert cli_main(["plan", "llama-3.1-8b", "--gpu-memory-gib", "80", "--kv-offloading-size", "-1"]) == 2
    assert "--kv-offloading-size" in capsys.readouterr().err


def test_models_with_sliding_windows_are_refused(tmp_path):
    mistral = dict(TINY_LLAMA, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=32)
    (tmp_path / "config.json").write_text(json.dumps(mistral))
    with pytest.raises(ValueError, match="--kv-offloading-size.*sliding-window"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", dtype="float32", max_model_len=256,
            kv_offloading_size=HOST_GIB)


def test_fp8_cache_round_trips_through_the_host_tier(model_dir):
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": tokens(rng, 40 + 9 * i)} for i in range(6)] * 2
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    fp8 = dict(kv_cache_dtype="fp8", attention_backend="torch")
    off = engine(model_dir, 20, **fp8).generate(prompts, params, use_tqdm=False)
    llm = engine(model_dir, 20, kv_offloading_size=HOST_GIB, preemption_mode="swap", **fp8)
    on = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]
    stats = llm.llm_engine.get_stats()
    assert stats.kv_transfer.host_hit_tokens > 0 and stats.kv_transfer.swaps_in > 0


@pytest.mark.slow  # the engine core in a process of its own
def test_host_tier_stats_reach_the_api_process(model_dir):
    llm = AsyncLLM.from_engine_args(EngineArgs(model_dir, load_format="dummy", device="cpu", dtype="float32",
                                               max_model_len=256, num_gpu_blocks_override=16, block_size=BLOCK,
                                               kv_offloading_size=HOST_GIB))
    rng = random.Random(5)
    prefix = tokens(rng, 6 * BLOCK)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run() -> None:
        for i, prompt in enumerate([prefix + tokens(rng, 10), *(tokens(rng, 150) for _ in range(3)),
                                    prefix + tokens(rng, 10)]):
            async for _ in llm.generate({"prompt_token_ids": prompt}, params, str(i)):
                pass
        await wait_for(lambda: llm.get_stats().kv_transfer is not None
                       and llm.get_stats().kv_transfer.host_hit_tokens == len(prefix))

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_swap_with_ngram_speculation_and_prompt_logprobs(model_dir):
    rng = random.Random(6)
    repeated = tokens(rng, 20) * 4  # prompt lookup finds drafts in it
    prompts = [{"prompt_token_ids": repeated[:40 + 9 * i] + tokens(rng, 5)} for i in range(8)] * 2
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2 if i % 5 == 0 else None) for i in range(len(prompts))]
    ngram = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}

    def run(**kwargs):
        llm = engine(model_dir, 20, **ngram, **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, str(o.prompt_logprobs)) for o in outputs], llm.llm_engine.get_stats()

    off, _ = run()
    swap, stats = run(kv_offloading_size=HOST_GIB, preemption_mode="swap")
    assert swap == off
    assert stats.num_preemptions > 0 and stats.kv_transfer.swaps_in > 0 and stats.spec.num_drafts > 0


@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_kv_role_limits_the_tier_to_saves_or_loads(model_dir, role):
    rng = random.Random(7)
    prefix, suffix = tokens(rng, 6 * BLOCK), tokens(rng, 10)
    config = {"kv_connector": "OffloadingConnector", "kv_role": role}
    llm = engine(model_dir, 16, kv_transfer_config=config, kv_offloading_size=HOST_GIB)
    _, _, stats = _evicted_prefix_run(llm, prefix, suffix, rng)
    assert (stats.kv_transfer.bytes_to_host > 0) == (role == "kv_producer")
    assert stats.kv_transfer.host_hit_tokens == 0 and stats.kv_transfer.bytes_to_device == 0
    with pytest.raises(ValueError, match="--preemption-mode.*kv_both"):
        EngineArgs(kv_transfer_config=config, kv_offloading_size=HOST_GIB, preemption_mode="swap").validate()
