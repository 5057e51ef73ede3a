"""Multi-LoRA on the embedded SmolLM2 against PEFT applied to Hugging Face's model of the same
weights: each adapter's greedy tokens and logprobs, and the fused CPU decoder layer (GGUF blocks,
adapters applied in C) against the same engine run module by module."""
from __future__ import annotations

import pytest

from engine_utils import assert_no_leak
from lora_utils import ALL_MODULES, greedy_reference, save_adapter
from pagellm import LLM, LoRARequest, SamplingParams

pytestmark = pytest.mark.slow  # the real model and the Hugging Face reference

NEW_TOKENS = 24
ADAPTERS = {  # name: (rank, alpha, targets)
    "qv8": (8, 16, ["q_proj", "v_proj"]),
    "all32": (32, 32, ALL_MODULES),
    "mlp64": (64, 128, ["gate_proj", "up_proj", "down_proj"]),
}
CONVERSATIONS = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "user", "content": "Write a haiku about autumn leaves."}]]


@pytest.fixture(scope="module")
def adapters(hf_smollm2_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-lora")
    made = {}
    for i, (name, (r, alpha, targets)) in enumerate(ADAPTERS.items()):
        model = save_adapter(hf_smollm2_model, root / name, r=r, alpha=alpha, targets=targets, seed=i, scale=0.3)
        made[name] = (LoRARequest(name, i + 1, str(root / name)), model)
    return made


@pytest.fixture(scope="module")
def prompts(smollm2_path) -> list[list[int]]:
    tok = LLM(smollm2_path, device="cpu", kv_cache_memory_bytes=16 << 20, max_model_len=256).get_tokenizer()
    return [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True), add_special_tokens=False)
            for c in CONVERSATIONS]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0)


def test_every_adapter_matches_peft(smollm2_path, adapters, prompts, hf_smollm2_model):
    llm = LLM(smollm2_path, dtype="float32", quantization="none", device="cpu", enable_lora=True, max_loras=3,
              max_lora_rank=64, kv_cache_memory_bytes=64 << 20, max_model_len=512)
    base_tokens, base_logprobs = greedy_reference(hf_smollm2_model, prompts[0], NEW_TOKENS)
    for name, (lora, peft_model) in adapters.items():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=lora, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            ref_tokens, ref_logprobs = greedy_reference(peft_model, prompt, NEW_TOKENS)
            seq = out.outputs[0]
            assert seq.token_ids == ref_tokens[:len(seq.token_ids)], name
            logprobs = [lp[t].logprob for lp, t in zip(seq.logprobs, seq.token_ids)]
            assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4, name
        # The adapter moved the output (else the comparison above could pass with adapters ignored).
        first = outs[0].outputs[0]
        moved = [abs(lp[t].logprob - b) for lp, t, b in zip(first.logprobs, first.token_ids, base_logprobs)]
        assert first.token_ids != base_tokens[:len(first.token_ids)] or max(moved) > 1e-2, name
    assert_no_leak(llm.llm_engine)


def test_the_fused_cpu_layer_applies_adapters_as_the_modules_do(smollm2_path, adapters, prompts):
    """GGUF blocks on the CPU run each decoder layer as one C call, which applies the adapters
    itself: a batch mixing three adapters and the base model equals the module-by-module run."""
    llm = LLM(smollm2_path, device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=64,
              kv_cache_memory_bytes=64 << 20, max_model_len=512)
    layers = llm.llm_engine.engine_core.executor.worker.runner.model.decoder_layers()
    fused = [layer.fused for layer in layers]
    assert all(f is not None and f._lora_batch is not None for f in fused)
    loras = [lora for lora, _ in adapters.values()] + [None]
    batch = [{"prompt_token_ids": prompts[i % 2]} for i in range(len(loras))]
    in_c = llm.generate(batch, GREEDY, lora_request=loras, use_tqdm=False)
    for layer in layers:
        layer.fused = None
    try:
        by_modules = llm.generate(batch, GREEDY, lora_request=loras, use_tqdm=False)
    finally:
        for layer, f in zip(layers, fused):
            layer.fused = f
    for a, b in zip(in_c, by_modules):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lp_a = [lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)]
        lp_b = [lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)]
        assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 1e-3
    assert len({tuple(o.outputs[0].token_ids) for o in in_c}) == len(loras)  # every adapter changed the output
    assert_no_leak(llm.llm_engine)
