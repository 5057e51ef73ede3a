"""Tensor and pipeline parallel on the CPU (gloo, one process per rank) against one rank.

SmolLM2 has 9 query heads, 3 KV heads and 30 layers: TP=3 and PP=2 must give the single rank's
greedy tokens. TP=2, TP=4 (KV heads replicated) and TP=2 x PP=2 run a tiny random model whose
heads divide, checked by logprobs. A rank killed mid-run fails the engine at once and
leaves no process behind.
"""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
import torch
from server_utils import RemoteServer
from test_greedy_vs_hf import CONVERSATIONS

from pagellm import LLM, SamplingParams
from pagellm.distributed import stage_layers
from pagellm.engine.arg_utils import EngineArgs
from pagellm.executor.base import WorkerFailedError
from pagellm.loader import resolve_model
from pagellm.tokenizer import load_tokenizer

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS)
CPU = {"dtype": "float32", "device": "cpu", "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 28}
# The splits must give one rank's tokens: SmolLM2 dequantized, as before GGUF blocks were kept
# (test_tensor_parallel_keeps_gguf_blocks_quantized runs those).
EXACT = {**CPU, "quantization": "none"}


pytestmark = pytest.mark.usefixtures("stop_ray_after_module")


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def chat_prompts(smollm2_path: str) -> list[list[int]]:
    tok = load_tokenizer(resolve_model(smollm2_path))
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in CONVERSATIONS[:5]]


@pytest.fixture(scope="module")
def single_rank_tokens(smollm2_path: str, chat_prompts) -> list[list[int]]:
    llm = LLM(smollm2_path, **EXACT)
    return _tokens(llm.generate(chat_prompts, GREEDY, use_tqdm=False))


def _run_split(smollm2_path: str, prompts, **kwargs) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt, and the number of preemptions."""
    llm = LLM(smollm2_path, **{**EXACT, **kwargs})
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        core = llm.llm_engine.engine_core
        assert not core.has_unfinished_requests()
        assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks
        return _tokens(outputs), core.stats().num_preemptions
    finally:
        llm.llm_engine.shutdown()


# Tensor parallel alone runs on Ray (ray-tp3); in processes, and with pipeline stages, on the tiny
# model below.
@pytest.mark.slow
@pytest.mark.parametrize("split", [
    {"pipeline_parallel_size": 2},
    # Small steps and a small cache: prefills are chunked across micro-batches and requests
    # preempt each other while others are in flight in the pipeline.
    {"pipeline_parallel_size": 2, "max_num_batched_tokens": 32, "max_num_seqs": 5,
     "max_model_len": 160, "num_gpu_blocks_override": 10},
    # One rank, in its own process: the process boundary alone.
    {"distributed_executor_backend": "mp"},
    # Ranks as Ray actors on a local Ray instance.
    {"tensor_parallel_size": 3, "distributed_executor_backend": "ray"},
], ids=["pp2", "pp2-chunked-preempted", "mp1", "ray-tp3"])
def test_split_model_gives_the_single_rank_greedy_tokens(smollm2_path, chat_prompts, single_rank_tokens, split):
    tokens, num_preemptions = _run_split(smollm2_path, chat_prompts, **split)
    assert tokens == single_rank_tokens
    if "num_gpu_blocks_override" in split:
        assert num_preemptions > 0


@pytest.mark.slow
def test_pipeline_stages_reuse_the_prefix_cache(smollm2_path, chat_prompts, single_rank_tokens):
    # The same prompts twice in one batch: the second copies hit blocks the first ones wrote.
    llm = LLM(smollm2_path, **EXACT, pipeline_parallel_size=2)
    try:
        llm.generate(chat_prompts[:2], GREEDY, use_tqdm=False)
        outputs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        assert stats.prefix_cache_hits > 0
        assert _tokens(outputs) == single_rank_tokens
    finally:
        llm.llm_engine.shutdown()


# -- TP=2, TP=4 and TP=2 x PP=2 on a tiny random model, compared by logprobs ---------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> str:
    """A random Qwen2-style model (biased q/k/v): 8 heads, 2 KV heads, vocab 330 (not a multiple of 4)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, Qwen2Config

    path = tmp_path_factory.mktemp("tiny-qwen2")
    config = Qwen2Config(vocab_size=330, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(330)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return str(path)


def _logprobs(path: str, **kwargs) -> tuple[list[list[int]], torch.Tensor]:
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 320 + 5 for j in range(9 + 4 * i)]} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    llm = LLM(path, **CPU, **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    values = []
    for out in outputs:
        for position in out.prompt_logprobs[1:]:
            values += sorted(lp.logprob for lp in position.values())
        for position in out.outputs[0].logprobs:
            values += sorted(lp.logprob for lp in position.values())
    return _tokens(outputs), torch.tensor(values)


@pytest.fixture(scope="module")
def tiny_one_rank(tiny_llama) -> tuple[list[list[int]], torch.Tensor]:
    return _logprobs(tiny_llama)


@pytest.mark.slow  # ranks in processes of their own (each starts Python and imports torch): tens of seconds
@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2}, {"tensor_parallel_size": 4},
                                   {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}],
                         ids=["tp2", "tp4", "tp2xpp2"])
def test_tensor_parallel_logprobs_match_one_rank(tiny_llama, tiny_one_rank, split):
    ref_tokens, ref = tiny_one_rank
    tokens, values = _logprobs(tiny_llama, **split)
    assert tokens == ref_tokens
    torch.testing.assert_close(values, ref, atol=1e-4, rtol=1e-4)


# -- failures -----------------------------------------------------------------------------------------

@pytest.mark.slow  # ranks in processes of their own (each starts Python and imports torch); Ray a cluster
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_killed_rank_fails_the_engine_within_seconds_and_no_rank_is_left(tiny_llama, backend):
    # Rank 1 is not the driver: the engine waits on rank 0, which waits on rank 1 in an all-reduce.
    llm = LLM(tiny_llama, **CPU, tensor_parallel_size=2, distributed_executor_backend=backend)
    engine = llm.llm_engine
    pids = engine.engine_core.executor.pids
    engine.add_request("0", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(WorkerFailedError, match="rank 1" if backend == "mp" else "Ray rank"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - killed < 10
    deadline = time.monotonic() + 10  # Ray reaps killed actors' processes by itself, shortly after
    while not all(_gone(pid) for pid in pids):
        assert time.monotonic() < deadline, "a rank outlived the engine"
        time.sleep(0.1)


@pytest.mark.slow  # ranks in processes of their own (each starts Python and imports torch): tens of seconds
def test_rank_dead_before_a_step_is_sent_fails_that_step(tiny_llama):
    """A rank that died between steps has no input pipe left: sending it the next step must fail
    the engine, not block the engine core forever while its heartbeats say it is fine."""
    llm = LLM(tiny_llama, **CPU, pipeline_parallel_size=2)
    engine = llm.llm_engine
    executor = engine.engine_core.executor
    engine.add_request("0", {"prompt_token_ids": list(range(100, 140))},
                       SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True))
    for _ in range(3):
        engine.step()
    os.kill(executor.pids[0], signal.SIGKILL)
    executor._procs[0].wait()  # dead and reaped before the engine sends again
    failure: list[BaseException] = []

    def run() -> None:
        try:
            while engine.has_unfinished_requests():
                engine.step()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            failure.append(e)

    stepper = threading.Thread(target=run, daemon=True)
    stepper.start()
    stepper.join(timeout=10)
    if stepper.is_alive():
        # Terminating the context ends the blocked send (ETERM): the test fails instead of hanging.
        threading.Thread(target=executor._ctx.term, daemon=True).start()
        stepper.join(timeout=10)
        pytest.fail("the engine blocked sending to a dead rank")
    assert len(failure) == 1 and isinstance(failure[0], WorkerFailedError), failure
    assert "rank 0" in str(failure[0])


@pytest.mark.slow
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tensor_parallel_size": 2},
     "tensor_parallel_size \\(--tensor-parallel-size\\) 2 must divide the model's num_attention_heads \\(9\\)"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size \\(--tensor-parallel-size\\) must be a positive integer"),
    ({"pipeline_parallel_size": 31},
     "pipeline_parallel_size \\(--pipeline-parallel-size\\) 31 exceeds the model's 30 layers"),
    ({"tensor_parallel_size": 3, "distributed_executor_backend": "uni"}, "'uni' runs one rank"),
    ({"distributed_executor_backend": "threads"},
     "distributed_executor_backend \\(--distributed-executor-backend\\) must be one of"),
])
def test_invalid_splits_fail_at_start_naming_the_flag(smollm2_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=smollm2_path, device="cpu", **kwargs).create_engine_config()


def test_stage_layers_are_contiguous_and_cover_the_model():
    for num_layers, stages in [(30, 2), (30, 4), (7, 3), (3, 3)]:
        ranges = [stage_layers(num_layers, s, stages) for s in range(stages)]
        assert [i for r in ranges for i in r] == list(range(num_layers))
        assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


# -- through the server -------------------------------------------------------------------------------

def _rank_pids(server: RemoteServer) -> list[int]:
    match = re.search(r"ranks ready \(pids ([\d ]+)\)", server.log_tail(1_000_000))
    assert match is not None, server.log_tail()
    return [int(pid) for pid in match.group(1).split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("mid_stream", [True, False], ids=["mid-stream", "idle"])
def test_server_with_a_killed_rank_fails_requests_and_exits_1_leaving_no_process(smollm2_path, mid_stream):
    server = RemoteServer(smollm2_path, "--device", "cpu", "--dtype", "float32", "--max-model-len", "1024",
                          "--kv-cache-memory-bytes", str(64 << 20), "--pipeline-parallel-size", "2",
                          "--served-model-name", "m")
    try:
        pids = [*_rank_pids(server), server.engine_pid()]
        if mid_stream:
            request = {"model": "m", "prompt": "Tell me a very long story.", "max_tokens": 900,
                       "ignore_eos": True, "stream": True}
            with httpx.Client(base_url=server.url, timeout=30.0) as http:
                with http.stream("POST", "/v1/completions", json=request) as response:
                    events = (line for line in response.iter_lines() if line.startswith("data: "))
                    next(events)
                    os.kill(pids[0], signal.SIGKILL)
                    killed = time.monotonic()
                    rest = list(events)
            assert time.monotonic() - killed < 10, "the stream ended late"
            assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2].removeprefix("data: "))
        else:
            os.kill(pids[1], signal.SIGKILL)
        assert server.process.wait(timeout=30) == 1
        assert "exited with code -9" in server.log_tail(1_000_000)
        assert all(_gone(pid) for pid in pids)
    finally:
        server.stop()


@pytest.mark.slow
def test_tensor_parallel_keeps_gguf_blocks_quantized(smollm2_path, chat_prompts):
    """Row-parallel layers take whole 32-value blocks of their input features: three ranks score the
    prompts as one rank does (the ranks' partial sums add in another order: float32 rounding)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def score(**kwargs) -> list[list[float]]:
        llm = LLM(smollm2_path, **CPU, **kwargs)
        try:
            assert llm.llm_engine.config.model.quantization == "gguf"
            outputs = llm.generate(chat_prompts[:2], params, use_tqdm=False)
            return [[lp[token].logprob for lp, token in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])]
                    for o in outputs]
        finally:
            llm.llm_engine.shutdown()

    for one, two in zip(score(), score(tensor_parallel_size=3)):
        assert max(abs(a - b) for a, b in zip(one, two)) < 1e-3


@pytest.mark.slow
def test_tensor_parallel_ranks_smooth_int8_activations_consistently(smollm2_path, chat_prompts):
    """Online int8 calibrates SmoothQuant on every rank; each rank's scales follow its own weight
    rows, folded into its own copy of the norm. Three ranks stay as close to the dense model as one
    rank does (their 8-bit activations round differently; scales that did not match would be far off)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def score(**kwargs) -> torch.Tensor:
        llm = LLM(smollm2_path, **CPU, **kwargs)
        try:
            outputs = llm.generate(chat_prompts[:2], params, use_tqdm=False)
            return torch.tensor([lp[token].logprob for o in outputs
                                 for lp, token in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:])])
        finally:
            llm.llm_engine.shutdown()

    dense = score(quantization="none")
    one, three = score(quantization="int8"), score(quantization="int8", tensor_parallel_size=3)
    assert (three - dense).abs().mean() < 1.5 * (one - dense).abs().mean()
