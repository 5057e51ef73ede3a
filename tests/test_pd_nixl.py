"""Disaggregated prefill/decode through the NixlConnector on the CPU: a producer engine and a consumer
engine in one process (two NIXL agents over UCX in host memory, the side channel over TCP), against
one engine doing both; a layout mismatch refused at handshake; blocks freed after a pull and after
the producer's timeout; the config's errors."""
from __future__ import annotations

import json
import random
import socket
import time

import pytest
import torch
from engine_utils import TINY_LLAMA, assert_no_leak
from pydantic import ValidationError

from benchmarks import pd_transfer as pd_transfer_bench
from pagellm import LLM, SamplingParams
from pagellm.config.kv_transfer import NIXL_CONNECTOR, KVTransferConfig, NixlSettings
from pagellm.core.nixl_connector import NixlMetadata, RemoteLoad, RemotePrefill
from pagellm.core.request import RequestStatus
from pagellm.engine.arg_utils import EngineArgs
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagellm.worker import nixl_connector
from pagellm.worker.nixl_connector import NixlWorker
from pagellm.worker.nixl_runs import run_descriptors

BLOCK = 16
LOGPROBS = 3


def free_port() -> int:
    """A port for a producer's handshake listener (and the next one, rank 1's, is left alone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("tiny-llama-pd")
    (folder / "config.json").write_text(json.dumps(dict(TINY_LLAMA, num_hidden_layers=2, max_position_embeddings=1024)))
    return str(folder)


def engine(model_dir: str, role: str | None = None, block_size: int = BLOCK, port: int = 0,
           timeout_s: float = 120.0, **kwargs) -> LLM:
    transfer = None if role is None else {
        "kv_role": role, "kv_connector_extra_config": {"side_channel_port": port or free_port(),
                                                      "abort_timeout_s": timeout_s}}
    return LLM(model_dir, load_format="dummy", device="cpu", dtype="float32", max_model_len=1024,
               num_gpu_blocks_override=200, block_size=block_size, max_num_batched_tokens=64, max_num_seqs=16,
               kv_transfer_config=transfer, **kwargs)


def params(max_tokens: int, transfer: dict | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=LOGPROBS,
                          extra_args=None if transfer is None else {"kv_transfer_params": transfer})


def stats(llm: LLM):
    return llm.llm_engine.engine_core.stats().kv_transfer


def drain(llm: LLM, timeout_s: float = 10.0) -> None:
    """Step an engine until it holds nothing (a producer frees its blocks when it learns of a pull)."""
    deadline = time.monotonic() + timeout_s
    while llm.llm_engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "blocks still held past the deadline"
        llm.llm_engine.step()


def disaggregated(producer: LLM, consumer: LLM, prompts: list[list[int]], max_tokens: int):
    """The router's part: each prompt prefilled on the producer (one token), then decoded on the consumer."""
    prefilled = producer.generate([{"prompt_token_ids": p} for p in prompts],
                                  params(1, {"do_remote_decode": True, "do_remote_prefill": False}))
    transfers = [out.kv_transfer_params for out in prefilled]
    assert all(t is not None and t["do_remote_prefill"] for t in transfers)
    return consumer.generate([{"prompt_token_ids": p} for p in prompts], [params(max_tokens, t) for t in transfers])


def assert_same(outs, refs) -> None:
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for mine, theirs in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            for token, lp in theirs.items():
                assert mine[token].logprob == pytest.approx(lp.logprob, abs=1e-4)


@pytest.fixture(scope="module")
def pair(model_dir):
    producer = engine(model_dir, "kv_producer")
    consumer = engine(model_dir, "kv_consumer")
    return producer, consumer


def test_consumer_decodes_as_one_engine_with_pulled_kv(model_dir, pair):
    producer, consumer = pair
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 17, 40, 300, 700)]
    prompts.append(prompts[3][:200] + [7] * 50)  # a prefix-cache hit on the producer
    reference = engine(model_dir).generate([{"prompt_token_ids": p} for p in prompts], params(12))
    before = stats(consumer)
    outs = disaggregated(producer, consumer, prompts, 12)
    assert_same(outs, reference)
    after = stats(consumer)
    assert after.remote_hit_tokens - before.remote_hit_tokens == sum(len(p) - 1 for p in prompts)
    assert after.transfers - before.transfers == len(prompts)
    assert after.transfer_failures == before.transfer_failures
    drain(producer)
    assert stats(producer).transfers >= len(prompts)
    assert_no_leak(producer.llm_engine)
    drain(consumer)
    assert stats(consumer).held_requests == 0


def test_abort_mid_pull_frees_blocks_on_both_sides(model_dir, pair, monkeypatch):
    producer, consumer = pair
    prompt = {"prompt_token_ids": list(range(3, 300))}
    [prefilled] = producer.generate([prompt], params(1, {"do_remote_decode": True}))
    engine = consumer.llm_engine
    # The consumer's worker (in this process) does not look at its pull yet: it stays in flight.
    monkeypatch.setattr(NixlWorker, "_poll_pulls", lambda self, report, now: None)
    engine.add_request("cut", prompt, params(8, prefilled.kv_transfer_params))
    engine.step()  # admitted: it holds its blocks while its pull runs
    assert engine.engine_core.scheduler.requests["cut"].status is RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request("cut")
    engine.step()
    assert engine.engine_core.scheduler.kv.pool.num_free_blocks < engine.engine_core.num_blocks  # still landing
    monkeypatch.undo()
    drain(consumer)  # the blocks come back once the pull in flight has landed
    assert_no_leak(engine)
    drain(producer)  # the pull's notice frees the producer's blocks
    assert_no_leak(producer.llm_engine)


@pytest.mark.slow  # two engines of two rank processes each
def test_tensor_parallel_ranks_pull_their_shards(model_dir, pair):
    producer = engine(model_dir, "kv_producer", tensor_parallel_size=2)
    # No prefix cache: the reference run (no transfer) must not leave the prompts cached there.
    consumer = engine(model_dir, "kv_consumer", tensor_parallel_size=2, enable_prefix_caching=False)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (30, 130)]
    reference = consumer.generate([{"prompt_token_ids": p} for p in prompts], params(8))
    outs = disaggregated(producer, consumer, prompts, 8)
    assert_same(outs, reference)
    assert stats(consumer).remote_hit_tokens == sum(len(p) - 1 for p in prompts)
    drain(producer)
    assert_no_leak(producer.llm_engine)
    # A producer of another tensor-parallel size is refused at handshake, naming tp_size.
    [prefilled] = pair[0].generate([{"prompt_token_ids": prompts[0]}], params(1, {"do_remote_decode": True}))
    [out] = consumer.generate([{"prompt_token_ids": prompts[0]}], params(8, prefilled.kv_transfer_params))
    assert out.outputs[0].token_ids == reference[0].outputs[0].token_ids
    assert stats(consumer).transfer_failures == 1


def test_pulls_land_the_exact_bytes_in_runs(model_dir, monkeypatch):
    """Two worker halves over caches of random bytes: a pull of consecutive blocks, one of descending
    blocks and one of scattered blocks copy exactly the producer's blocks onto the consumer's asked for
    and touch no other block; consecutive stretches move as one descriptor per cache tensor."""
    def worker(role: str, fill) -> NixlWorker:
        transfer = {"kv_role": role, "kv_connector_extra_config": {"side_channel_port": free_port()}}
        config = EngineArgs(model_dir, load_format="dummy", device="cpu", block_size=BLOCK,
                            kv_transfer_config=transfer).create_engine_config()
        arch = config.model.source.arch
        shape = (64, BLOCK, arch.num_key_value_heads, arch.head_dim)
        return NixlWorker(config, [(fill(shape), fill(shape)) for _ in range(arch.num_hidden_layers)])

    torch.manual_seed(0)
    producer, consumer = worker("kv_producer", torch.randn), worker("kv_consumer", torch.zeros)
    rows = []  # the descriptor lists of the pull: local, then remote

    def recorded(*args):
        rows.append(run_descriptors(*args))
        return rows[-1]

    monkeypatch.setattr(nixl_connector, "run_descriptors", recorded)
    settings = producer.settings
    rng = random.Random(3)
    pulls = {"consecutive": (list(range(20, 36)), list(range(40, 56))),
             "descending": (list(range(15, 5, -1)), list(range(63, 53, -1))),
             "scattered": (rng.sample(range(0, 64, 2), 12), rng.sample(range(20), 12))}  # no two ids adjacent
    for name, (src, dst) in pulls.items():
        for tensor in (t for pair in consumer.kv_caches for t in pair):
            tensor.zero_()
        rows.clear()
        remote = RemotePrefill(settings.engine_id, settings.side_channel_host, settings.side_channel_port, name,
                               tuple(src), settings.tp_size)
        consumer.start_load_kv(NixlMetadata(loads=[RemoteLoad(name, remote, dst, src)]))
        deadline = time.monotonic() + 10
        while (report := consumer.get_finished()) is None or name not in report.finished_recving:
            assert time.monotonic() < deadline, f"the {name} pull did not end"
        assert not report.failed_block_ids
        assert report.transfer_bytes == len(src) * producer.block_bytes * producer.num_tensors
        others = torch.ones(64, dtype=torch.bool)
        others[dst] = False
        for (pk, pv), (ck, cv) in zip(producer.kv_caches, consumer.kv_caches):
            for mine, theirs in ((ck, pk), (cv, pv)):
                assert torch.equal(mine[dst], theirs[src]), name
                assert not mine[others].any(), name
        local_rows, remote_rows = rows
        assert len(local_rows) == len(remote_rows) == producer.num_tensors * (len(src) if name == "scattered" else 1)
    producer.listener.close()


def test_block_size_mismatch_refused_and_recomputed(model_dir, pair):
    producer, _ = pair
    consumer = engine(model_dir, "kv_consumer", block_size=32)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(60)]]
    reference = engine(model_dir, block_size=32).generate([{"prompt_token_ids": p} for p in prompts], params(6))
    outs = disaggregated(producer, consumer, prompts, 6)
    assert_same(outs, reference)
    assert stats(consumer).transfer_failures == 1
    assert stats(consumer).remote_hit_tokens == 0
    drain(producer)  # the refusing consumer told the producer to free its blocks
    assert_no_leak(producer.llm_engine)


def test_producer_frees_unpulled_blocks_after_timeout(model_dir):
    producer = engine(model_dir, "kv_producer", timeout_s=0.3)
    out = producer.generate([{"prompt_token_ids": list(range(3, 60))}], params(1, {"do_remote_decode": True}))
    assert out[0].kv_transfer_params["remote_block_ids"]
    core = producer.llm_engine.engine_core
    assert core.scheduler.kv.pool.num_free_blocks < core.num_blocks  # held for a pull that never comes
    drain(producer)
    assert_no_leak(producer.llm_engine)


@pytest.mark.parametrize("value, key", [
    ({"kv_role": "kv_decoder"}, "kv_role"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {"side_channel_prot": 1}}, "side_channel_prot"),
    ({"kv_role": "kv_producer", "kv_connector_extra_config": {"abort_timeout_s": -1}}, "abort_timeout_s"),
    ({"kv_connector": "NixlConector", "kv_role": "kv_producer"}, "kv_connector"),
])
def test_bad_config_names_the_key(model_dir, value, key):
    with pytest.raises(ValueError, match=key):
        EngineArgs(model_dir, load_format="dummy", device="cpu", kv_transfer_config=value).create_engine_config()


def test_role_alone_picks_nixl():
    transfer = KVTransferConfig.parse('{"kv_role": "kv_consumer"}')
    assert transfer.kv_connector == NIXL_CONNECTOR
    assert NixlSettings.parse(transfer).abort_timeout_s == 120.0


def test_benchmark_smoke_pulls_and_decodes(model_dir):
    payload = pd_transfer_bench.main(["--model", model_dir, "--device", "cpu", "--smoke"])
    assert all(record["status"] == "ok" for record in payload["phases"].values()), payload["phases"]
    pull, run = payload["results"]["pull"], payload["results"]["engines"]
    assert pull["bytes"] > 0 and pull["consecutive"]["nixl_pull_GBps"] > 0 and pull["scattered"]["nixl_pull_GBps"] > 0
    with open(f"{model_dir}/config.json") as f:
        tensors = 2 * json.load(f)["num_hidden_layers"]  # keys and values of each layer
    assert pull["consecutive"]["descriptors_per_pull"] == tensors  # one run of every tensor
    assert pull["scattered"]["descriptors_per_pull"] > tensors
    assert run["pulls"] == run["prompts"] and run["failures"] == 0 and run["bytes"] > 0


def test_openai_requests_carry_kv_transfer_params():
    transfer = {"do_remote_decode": True, "do_remote_prefill": False}
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], kv_transfer_params=transfer)
    assert chat.to_sampling_params(1).extra_args == {"kv_transfer_params": transfer}
    completion = CompletionRequest(model="m", prompt="hi", kv_transfer_params=transfer)
    assert completion.to_sampling_params(1).extra_args == {"kv_transfer_params": transfer}
    assert CompletionRequest(model="m", prompt="hi").to_sampling_params(1).extra_args is None
    with pytest.raises(ValidationError, match="kv_transfer_params"):
        CompletionRequest(model="m", prompt="hi", n=2, kv_transfer_params=transfer)
    with pytest.raises(ValueError, match="kv_transfer_params"):
        SamplingParams(extra_args={"kv_transfer_params": "yes"})
