"""Multi-LoRA on a tiny random Llama against PEFT (the reference), and the engine's handling of
adapters: mixed batches, scheduling features, the max_loras limit, prefix-cache isolation, bad input."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_utils import assert_no_leak
from lora_utils import ALL_MODULES, greedy_reference, save_adapter, save_tiny_llama
from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams

NEW_TOKENS = 12
PROMPTS = [[1, 17, 99, 4, 250, 31, 8, 77, 5], [1, 200, 3, 3, 41], [1, 9, 180, 64, 12, 12, 90, 7, 33, 2 + 100, 15]]
ADAPTERS = {  # name: (rank, alpha, targets, rsLoRA)
    "qv8": (8, 16, ["q_proj", "v_proj"], False),
    "all16": (16, 8, ALL_MODULES, False),
    "mlp32": (32, 64, ["o_proj", "gate_proj", "up_proj", "down_proj"], True),
    "kd64": (64, 32, ["k_proj", "down_proj"], False),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The base model's folder and HF model, and per adapter its LoRARequest and PEFT model."""
    root = tmp_path_factory.mktemp("lora")
    base_dir = root / "base"
    base = save_tiny_llama(base_dir)
    adapters = {}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        folder = root / name
        peft_model = save_adapter(base, folder, r=r, alpha=alpha, targets=targets, seed=10 + i, use_rslora=rslora,
                                  scale=4.0)
        adapters[name] = (LoRARequest(name, i + 1, str(folder)), peft_model)
    return base_dir, base, adapters


def engine(base_dir, **kwargs) -> LLM:
    args = dict(device="cpu", dtype="float32", enable_lora=True, max_lora_rank=64, max_loras=4,
                kv_cache_memory_bytes=4 << 20, max_model_len=256)
    return LLM(str(base_dir), **{**args, **kwargs})


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return engine(tiny[0])


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)


def tokens_and_logprobs(out) -> tuple[list[int], list[float]]:
    seq = out.outputs[0]
    return seq.token_ids, [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_matches_peft(tiny, llm, name):
    lora, peft_model = tiny[2][name]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, lora_request=lora, use_tqdm=False)
    base_outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref_tokens, ref_logprobs = greedy_reference(peft_model, prompt, NEW_TOKENS)
        tokens, logprobs = tokens_and_logprobs(out)
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4
    # The adapter changes what the model says (else this test could pass with adapters ignored).
    assert tokens_and_logprobs(outs[0])[1] != pytest.approx(tokens_and_logprobs(base_outs[0])[1], abs=1e-3)
    assert_no_leak(llm.llm_engine)


def test_one_batch_mixing_four_adapters_and_the_base_model(tiny, llm):
    names = list(ADAPTERS)
    loras = [tiny[2][n][0] for n in names] + [None]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(loras))]
    mixed = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    for prompt, lora, out in zip(prompts, loras, mixed):
        alone = llm.generate([prompt], GREEDY, lora_request=lora, use_tqdm=False)[0]
        tokens, logprobs = tokens_and_logprobs(out)
        assert tokens == alone.outputs[0].token_ids
        assert logprobs == pytest.approx(tokens_and_logprobs(alone)[1], abs=1e-5)
    base_ref = greedy_reference(tiny[1], prompts[-1]["prompt_token_ids"], NEW_TOKENS)[0]
    assert mixed[-1].outputs[0].token_ids == base_ref


@pytest.mark.parametrize("variant", [
    dict(max_num_batched_tokens=4, max_num_seqs=4),   # chunked prefill: prompts over several steps
    dict(num_gpu_blocks_override=3, block_size=8, max_model_len=24),   # preemption: too few blocks for all
])
def test_scheduling_variants_keep_each_adapters_output(tiny, llm, variant):
    loras = [tiny[2][n][0] for n in ADAPTERS] + [None]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(loras))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)]
    other = engine(tiny[0], **variant)
    outs = other.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    if "num_gpu_blocks_override" in variant:
        assert other.llm_engine.get_stats().num_preemptions > 0
    assert_no_leak(other.llm_engine)


def test_max_loras_one_runs_every_adapter_in_turn_without_starving(tiny, llm):
    """With one slot, requests of four adapters and the base model all finish with their own outputs."""
    loras = [tiny[2][n][0] for n in ADAPTERS for _ in range(2)] + [None] * 2
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(loras))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)]
    one = engine(tiny[0], max_loras=1, max_cpu_loras=2)
    outs = one.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = one.llm_engine.get_stats().lora
    assert stats.max_loras == 1 and stats.num_loads >= 4 and stats.num_evictions >= 2
    assert stats.running == [] and stats.waiting == []
    assert_no_leak(one.llm_engine)


def test_prefix_cache_is_kept_apart_per_adapter(tiny, llm):
    qv8, all16 = tiny[2]["qv8"][0], tiny[2]["all16"][0]
    prompt = {"prompt_token_ids": [1] + list(range(10, 60))}  # three full blocks of 16

    def hits(lora) -> int:
        before = llm.llm_engine.get_stats().prefix_cache_hits
        llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1), lora_request=lora, use_tqdm=False)
        return llm.llm_engine.get_stats().prefix_cache_hits - before

    assert hits(qv8) == 0
    assert hits(qv8) == 48  # the same adapter reuses its blocks
    assert hits(all16) == 0  # another adapter never sees them
    assert hits(None) == 0  # nor does the base model
    assert hits(all16) == 48


def test_n_greater_than_one_and_structured_output_with_an_adapter(tiny, llm):
    lora, peft_model = tiny[2]["all16"]
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, SamplingParams(n=3, temperature=0.0, max_tokens=6),
                       lora_request=lora, use_tqdm=False)[0]
    ref = greedy_reference(peft_model, PROMPTS[0], 6)[0]
    assert [c.token_ids for c in out.outputs] == [ref] * 3
    choices = ["t40", "t41"]
    constrained = llm.generate({"prompt_token_ids": PROMPTS[0]},
                               SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=choices)),
                               lora_request=lora, use_tqdm=False)[0]
    # The choice, then EOS (token 2, "t2": this tokenizer marks no token special).
    assert constrained.outputs[0].token_ids in ([40, 2], [41, 2])


def test_ngram_speculation_with_adapters_keeps_greedy_output(tiny, llm):
    loras = [tiny[2][n][0] for n in ADAPTERS] + [None]
    repetitive = [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
    prompts = [{"prompt_token_ids": repetitive}] * len(loras)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    spec = engine(tiny[0], speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 2})
    outs = spec.generate(prompts, params, lora_request=loras, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert spec.llm_engine.get_stats().spec.num_draft_tokens > 0
    assert_no_leak(spec.llm_engine)


def test_embeddings_with_an_adapter_match_peft(tiny):
    lora, peft_model = tiny[2]["all16"]
    pooling = engine(tiny[0], runner="pooling")
    vec = pooling.embed({"prompt_token_ids": PROMPTS[1]}, lora_request=lora, use_tqdm=False)[0].outputs.embedding
    base = pooling.embed({"prompt_token_ids": PROMPTS[1]}, use_tqdm=False)[0].outputs.embedding
    with torch.no_grad():
        hidden = peft_model(torch.tensor([PROMPTS[1]]), output_hidden_states=True).hidden_states[-1][0, -1]
    ref = torch.nn.functional.normalize(hidden, dim=-1)
    assert torch.tensor(vec) == pytest.approx(ref, abs=1e-5)
    assert not torch.allclose(torch.tensor(base), ref, atol=1e-3)


# -- bad input --------------------------------------------------------------------------------------


def break_adapter(src, dst, edit) -> str:
    """A copy of adapter folder `src` in `dst`, its config and tensors passed through `edit`."""
    dst.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(src / "adapter_model.safetensors")
    config, tensors = edit(config, tensors)
    (dst / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, dst / "adapter_model.safetensors")
    return str(dst)


def widened(tensors):
    key = next(k for k in tensors if "lora_A" in k)
    return {**tensors, key: torch.zeros(tensors[key].shape[0], tensors[key].shape[1] + 8)}


@pytest.mark.parametrize("edit, message", [
    (lambda c, t: ({**c, "r": 128}, {k: torch.zeros(128, v.shape[1]) if "lora_A" in k else torch.zeros(v.shape[0], 128)
                                    for k, v in t.items()}), "rank 128 is larger than max_lora_rank"),
    (lambda c, t: (c, widened(t)), "do not fit the base model"),
    (lambda c, t: ({**c, "use_dora": True}, t), "DoRA"),
    (lambda c, t: ({**c, "modules_to_save": ["lm_head"]}, t), "modules_to_save"),
    (lambda c, t: (c, {k.replace("q_proj", "rotary"): v for k, v in t.items()}), "adapts no linear layer|not an adaptable"),
    (lambda c, t: (c, {k: v for k, v in t.items() if "lora_B" not in k}), "not both lora_A and lora_B"),
    (lambda c, t: ({**c, "r": "eight"}, t), "r must be a positive integer"),
])
def test_bad_adapters_are_refused_by_name_and_the_engine_goes_on(tiny, llm, tmp_path, edit, message):
    src = tiny[2]["qv8"][0].lora_path
    from pathlib import Path

    path = break_adapter(Path(src), tmp_path / "bad", edit)
    with pytest.raises(ValueError, match=message):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=LoRARequest("bad", 99, path),
                     use_tqdm=False)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=tiny[2]["qv8"][0], use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == NEW_TOKENS
    assert_no_leak(llm.llm_engine)


def test_missing_files_and_misuse_are_value_errors(tiny, llm, tmp_path):
    prompt = {"prompt_token_ids": PROMPTS[0]}
    with pytest.raises(ValueError, match="does not exist"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("gone", 50, str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("empty", 51, str(tmp_path / "empty")))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        llm.generate(prompt, GREEDY, lora_request=LoRARequest("junk", 52, str(tmp_path / "junk")))
    with pytest.raises(ValueError, match="lora_int_id must be a positive integer"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="2 entries but there are 1 prompts"):
        llm.generate(prompt, GREEDY, lora_request=[None, None])
    plain = LLM(str(tiny[0]), device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20, max_model_len=256)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.generate(prompt, GREEDY, lora_request=tiny[2]["qv8"][0])


def test_one_id_names_one_adapter(tiny, llm):
    """Reusing an id for another path is refused (its KV blocks and slot would be another adapter's)."""
    first = tiny[2]["qv8"][0]
    impostor = LoRARequest("impostor", first.lora_int_id, tiny[2]["all16"][0].lora_path)
    llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=first, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=impostor, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "abort"
    assert_no_leak(llm.llm_engine)


@pytest.mark.parametrize("flags, message", [
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras .* must be >= .*max_loras"),
    (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(lora_dtype="int8"), "lora_dtype"),
    (dict(tensor_parallel_size=2), "one tensor-parallel rank"),
])
def test_bad_lora_flags_name_the_flag(tiny, flags, message):
    with pytest.raises(ValueError, match=message):
        engine(tiny[0], **flags)


def test_rslora_scaling_is_alpha_over_sqrt_rank(tiny):
    from pagellm.config.arch import ModelArchConfig
    from pagellm.config.lora import LoRAConfig
    from pagellm.lora.adapter import load_adapter

    arch = ModelArchConfig.from_hf_dict(json.loads((tiny[0] / "config.json").read_text()))
    lora, peft_model = tiny[2]["mlp32"]
    adapter = load_adapter(lora, arch, LoRAConfig(max_lora_rank=64))
    b_peft = dict(peft_model.named_parameters())["base_model.model.model.layers.0.mlp.down_proj.lora_B.default.weight"]
    _, b = adapter.weights["model.layers.0.mlp.down_proj"]
    assert torch.allclose(b, b_peft * 64 / math.sqrt(32), atol=1e-6)


@pytest.mark.parametrize("padded", [None, 40])
def test_the_kernel_path_equals_the_torch_path(padded):
    """An adapted layer through `LoRABatch` with the Triton kernels (interpreted here) against the
    torch path: rows of three slots and the base model, parts of a fused layer, a lower rank in one
    slot, and a plan padded as a CUDA graph's (extra rows, no adapter)."""
    pytest.importorskip("triton")
    from pagellm.config.lora import LoRAConfig
    from pagellm.layers import MergedColumnParallelLinear
    from pagellm.lora.adapter import LoRAAdapter
    from pagellm.lora.batch import LoRABatch
    from pagellm.lora.layers import AdaptedLinear

    torch.manual_seed(0)
    config = LoRAConfig(max_loras=3, max_lora_rank=16, max_cpu_loras=3)
    base = MergedColumnParallelLinear(32, [48, 32])
    torch.nn.init.normal_(base.weight)
    names = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    results = []
    for use_kernels in (False, True):
        batch = LoRABatch(3, 64, torch.device("cpu"), use_kernels=use_kernels)
        layer = AdaptedLinear(base, names, (0, 48, 80), config, batch, torch.device("cpu"))
        for slot, (rank, parts) in enumerate([(16, names), (8, names[1:]), (4, names)]):
            gen = torch.Generator().manual_seed(slot)
            weights = {n: (torch.randn(rank, 32, generator=gen), torch.randn(48 if "gate" in n else 32, rank,
                                                                             generator=gen)) for n in parts}
            layer.load(slot, LoRAAdapter(LoRARequest(f"a{slot}", slot + 1, "/p"), rank, weights))
        slots = torch.tensor([2, -1, 0, 0, 1, 2, -1, 1, 1, 0, 2, 2] * 2).numpy()
        batch.prepare(slots, padded)
        x = torch.randn(len(slots), 32, generator=torch.Generator().manual_seed(7))
        results.append(base(x))
        base._forward_hooks.clear()
    torch_path, kernel_path = results
    plain = x @ base.weight.t()
    assert not torch.allclose(torch_path, plain, atol=1e-2)
    assert torch.allclose(kernel_path, torch_path, atol=1e-3, rtol=1e-4)


@pytest.mark.slow  # two rank processes
def test_adapters_reach_every_pipeline_stage_over_processes(tiny, llm):
    """Pipeline stages in processes of their own (the mp executor): each stage gets the adapter
    from the engine core and adapts its own layers; outputs equal the one-rank engine's."""
    loras = [tiny[2][n][0] for n in ADAPTERS] + [None]
    prompts = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(len(loras))]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)]
    staged = engine(tiny[0], pipeline_parallel_size=2, distributed_executor_backend="mp")
    try:
        outs = staged.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
    finally:
        staged.llm_engine.shutdown()
