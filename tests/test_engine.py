"""The engine end to end on SmolLM2: validation, aborts, streaming, stop conditions, seeds, leaks."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref

import pytest

from pagellm import LLM, EngineArgs, SamplingParams
from pagellm.cli import main as cli_main
from pagellm.worker.model_runner import ModelRunner
from engine_utils import assert_no_leak

SMALL_KV = 64 << 20  # 91 blocks of 16 tokens in float32: room for max_model_len 1024


@pytest.fixture(scope="module")
def llm(smollm2_path) -> LLM:
    return LLM(smollm2_path, dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV, max_model_len=1024)


def prompt_ids(llm: LLM, text: str) -> list[int]:
    return llm.get_tokenizer().encode(text)


@pytest.mark.parametrize("kwargs, field", [
    (dict(block_size=7), "block_size"),
    (dict(dtype="float64"), "dtype"),
    (dict(load_format="pickle"), "load_format"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_batched_tokens=8, max_num_seqs=16), "max_num_batched_tokens"),
    # Checked against the default model's heads: reads the real GGUF.
    pytest.param(dict(tensor_parallel_size=2), "tensor_parallel_size", marks=pytest.mark.slow),
    (dict(device="tpu"), "device"),
    (dict(max_num_seq=4), "max_num_seq"),
])
def test_invalid_engine_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LLM(device=kwargs.pop("device", "cpu"), **kwargs)


@pytest.mark.slow
def test_max_model_len_that_cannot_fit_fails_at_start_with_numbers(smollm2_path):
    with pytest.raises(ValueError, match=r"4 blocks x 16 tokens = 64 tokens.*max_model_len \(1024\)"):
        LLM(smollm2_path, device="cpu", num_gpu_blocks_override=4, max_model_len=1024)


@pytest.mark.slow
def test_bad_prompts_raise_and_leave_the_engine_clean(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 49152]], greedy, use_tqdm=False)
    too_long = [{"prompt_token_ids": [5] * llm.llm_engine.config.model.max_model_len}]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["Hello", *too_long], greedy, use_tqdm=False)  # the good one is withdrawn too
    assert_no_leak(llm.llm_engine)
    out = llm.generate("Hello", greedy, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.slow
def test_sampling_params_count_must_match_prompts(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


@pytest.mark.slow
def test_stop_conditions_and_finish_reasons(llm):
    ids = prompt_ids(llm, "Count: one, two, three,")
    free = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(tokens) == 12
    # Stopping on the 5th greedy token gives exactly the first five tokens.
    stopped = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tokens[4]],
                                                 ignore_eos=True), use_tqdm=False)[0]
    first = tokens.index(tokens[4])
    assert stopped.outputs[0].token_ids == tokens[:first + 1]
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason == tokens[4]
    assert_no_leak(llm.llm_engine)


@pytest.mark.slow
def test_eos_ends_generation_unless_ignored(llm):
    chat = [{"role": "user", "content": "Say hi."}]
    out = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None
    eos = llm.get_tokenizer().eos_token_id
    n = len(out.outputs[0].token_ids)
    assert out.outputs[0].token_ids[-1] == eos
    longer = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=n + 5, ignore_eos=True), use_tqdm=False)[0]
    assert len(longer.outputs[0].token_ids) == n + 5
    assert longer.outputs[0].token_ids[:n] == out.outputs[0].token_ids


@pytest.mark.slow
def test_streaming_engine_with_abort(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("keep", "The weather today is", params)
    engine.add_request("drop", "Once upon a time", params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("keep", "duplicate", params)
    texts: dict[str, list[str]] = {"keep": [], "drop": []}
    aborted = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id].append(out.outputs[0].text)
            if out.request_id == "drop" and len(out.outputs[0].token_ids) == 5:
                aborted = engine.abort_request("drop")
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    assert len(aborted[0].outputs[0].token_ids) == 5
    # Cumulative outputs: every streamed text extends the previous one.
    for seq in texts.values():
        assert all(b.startswith(a) for a, b in zip(seq, seq[1:]))
    assert len(texts["keep"]) == 20 and len(texts["drop"]) == 5
    assert_no_leak(engine)


@pytest.mark.slow
def test_seeded_sampling_is_reproducible_alone_and_batched(llm):
    ids = prompt_ids(llm, "My favourite animal is")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate([ids], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    batch = llm.generate([prompt_ids(llm, "x y z"), ids, prompt_ids(llm, "Hello")], [others, seeded, others],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=4321, ignore_eos=True)
    assert llm.generate([ids], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


@pytest.mark.slow
def test_seeded_sampling_survives_preemption(smollm2_path, llm):
    ids = [prompt_ids(llm, f"Story number {i}: once upon a time") for i in range(6)]
    params = [SamplingParams(temperature=0.8, max_tokens=24, seed=i, ignore_eos=True) for i in range(6)]
    reference = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    # 10 blocks x 16 tokens: one request fits, all six (~34 tokens each) do not.
    tight = LLM(smollm2_path, dtype="float32", device="cpu", num_gpu_blocks_override=10, max_model_len=160)
    outs = tight.generate(ids, params, use_tqdm=False)
    assert tight.llm_engine.get_stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert_no_leak(tight.llm_engine)


@pytest.mark.slow
def test_engine_seed_makes_unseeded_sampling_repeat(smollm2_path):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(smollm2_path, dtype="float32", device="cpu", seed=7, kv_cache_memory_bytes=SMALL_KV, max_model_len=1024)
        runs.append([o.outputs[0].token_ids for o in llm.generate(["Hi", "Tell me"], params, use_tqdm=False)])
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_largest_step_runs_before_the_cache_exists(smollm2_path):
    # The GPU memory-profiling pass, exercised on the CPU: a full token budget of fresh prompts.
    config = EngineArgs(smollm2_path, device="cpu", dtype="float32", max_num_batched_tokens=256,
                        max_num_seqs=16).create_engine_config()
    runner = ModelRunner(config)
    runner.load_model()
    sampled = runner.run_largest_step()
    assert sampled.shape == (16,)
    assert int(sampled.min()) >= 0 and int(sampled.max()) < config.model.source.arch.vocab_size


def test_dummy_weights_from_a_config_directory(tmp_path):
    config = {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="dummy"):
        LLM(str(tmp_path), device="cpu")
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", dtype="float32", kv_cache_memory_bytes=SMALL_KV)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    assert_no_leak(llm.llm_engine)


@pytest.mark.slow  # the default (real) model
def test_cli_generate(capsys):
    code = cli_main(["generate", "--prompt", "What is 2+2?", "--max-tokens", "8", "--device", "cpu",
                     "--dtype", "float32", "--kv-cache-memory-bytes", str(SMALL_KV), "--max-model-len", "1024"])
    printed = capsys.readouterr().out
    assert code == 0
    assert ">>> What is 2+2?" in printed and "tokens]" in printed
    assert cli_main(["generate", "--block-size", "7", "--device", "cpu"]) == 2
    assert "block_size" in capsys.readouterr().err


@pytest.mark.slow
def test_the_engine_is_frozen_out_of_the_garbage_collector_and_still_freed(smollm2_path):
    """gc.freeze() after start-up (full collections skip the engine's objects), and an engine
    dropped without shutdown is still freed by reference counting alone, weights included (a
    frozen cycle would hold them until exit: a second engine in the process found 15 GiB less)."""
    gc.unfreeze()
    engine = LLM(smollm2_path, dtype="float32", device="cpu", kv_cache_memory_bytes=SMALL_KV, max_model_len=256)
    engine.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    assert gc.get_freeze_count() > 0
    model = weakref.ref(engine.llm_engine.engine_core.executor.worker.runner.model)
    weight = weakref.ref(model().model.layers[0].mlp.gate_up_proj.weight)  # loaders (bound to layers) dropped
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del engine
        assert model() is None and weight() is None
    finally:
        if was_enabled:
            gc.enable()


@pytest.mark.slow  # a Python process of its own (imports torch): seconds
def test_frozen_objects_are_released_at_exit(tmp_path):
    """Start-up objects are unfrozen at exit, so the interpreter's last collection sees them:
    Triton's native bindings (nanobind) report leaked objects at exit otherwise."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 128}))
    script = ("import triton\n"
              "from pagellm import LLM, SamplingParams\n"
              f"llm = LLM({str(tmp_path)!r}, load_format='dummy', device='cpu', dtype='float32', max_model_len=64,"
              " kv_cache_memory_bytes=1 << 20)\n"
              "llm.generate([{'prompt_token_ids': [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "leaked" not in result.stderr, result.stderr[-2000:]
