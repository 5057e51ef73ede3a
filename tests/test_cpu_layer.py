"""The fused CPU decoder layer (`pagellm/models/cpu_layer.py`): one C call per layer gives the
layer's modules' results bit for bit, and a layer that does not qualify keeps its modules."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.models import cpu_layer
from pagellm.ops.c import build as native
from pagellm.worker import loading, model_runner

pytestmark = [pytest.mark.slow,  # engines on the real model
              pytest.mark.skipif(native.unavailable_reason() is not None, reason=str(native.unavailable_reason()))]

# A 48-token budget splits the long prompt into chunks that share steps with the others' decodes.
ENGINE = dict(dtype="float32", device="cpu", kv_cache_memory_bytes=32 << 20, max_model_len=512,
              max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=False)
PROMPTS = [list(range(200, 290)), [1, 9690, 198, 2683, 359], list(range(5000, 5020))]


def decoder_layers(llm: LLM) -> list:
    return llm.llm_engine.engine_core.executor.worker.runner.model.decoder_layers()


def results(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs],
             [None if step is None else {t: lp.logprob for t, lp in step.items()} for step in o.prompt_logprobs])
            for o in outs]


def test_fused_layers_give_the_modules_results_bit_for_bit(smollm2_path, monkeypatch):
    fused = LLM(smollm2_path, **ENGINE)
    assert all(isinstance(layer.fused, cpu_layer.FusedDecoderLayer) for layer in decoder_layers(fused))
    got = results(fused)
    fused.llm_engine.shutdown()

    monkeypatch.setattr(loading, "fuse_decoder_layers", lambda layers: False)
    modules = LLM(smollm2_path, **ENGINE)
    layers = decoder_layers(modules)
    assert all(layer.fused is None and cpu_layer.why_not_fused(layer) is None for layer in layers)
    assert got == results(modules)  # exact floats: the same kernels in the same order


def test_fused_layers_keep_a_sliding_window_bit_for_bit(smollm2_path, monkeypatch):
    """Every attention layer given a 24-token window (shorter than the 90-token prompt): the fused
    layers attend within it as the modules do, and the window changes the results."""
    plain = LLM(smollm2_path, **ENGINE)
    unwindowed = results(plain)
    plain.llm_engine.shutdown()
    build = model_runner.build_model

    def windowed(*args, **kwargs):
        model = build(*args, **kwargs)
        for attn in model.attention_layers():
            attn.sliding_window = 24
        return model

    monkeypatch.setattr(model_runner, "build_model", windowed)
    fused = LLM(smollm2_path, **ENGINE)
    assert all(isinstance(layer.fused, cpu_layer.FusedDecoderLayer) for layer in decoder_layers(fused))
    got = results(fused)
    fused.llm_engine.shutdown()
    monkeypatch.setattr(loading, "fuse_decoder_layers", lambda layers: False)
    modules = LLM(smollm2_path, **ENGINE)
    assert got == results(modules)
    assert got[0] != unwindowed[0]


def test_dense_weights_keep_the_modules(smollm2_path):
    llm = LLM(smollm2_path, **ENGINE, quantization="none")
    layer = decoder_layers(llm)[0]
    assert layer.fused is None
    assert cpu_layer.why_not_fused(layer) == "not every projection keeps GGUF blocks"
