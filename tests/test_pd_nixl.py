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
from engine_utils import TINY_LLAMA, assert_no_leak

from pagellm import LLM, SamplingParams
from pagellm.config.kv_transfer import NIXL_CONNECTOR, KVTransferConfig, NixlSettings
from pagellm.engine.arg_utils import EngineArgs

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


@pytest.mark.slow
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
    assert stats(producer).held_requests == len(prompts) or stats(producer).transfers > 0
    drain(producer)
    assert stats(producer).transfers >= len(prompts)
    assert_no_leak(producer.llm_engine)
    drain(consumer)
    assert stats(consumer).held_requests == 0


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
