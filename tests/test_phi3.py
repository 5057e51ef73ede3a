"""Phi-3 against Hugging Face `transformers`: tiny random models built from `Phi3Config` (grouped-query
attention; LongRoPE served within and beyond its original context), saved as safetensors with their
fused qkv_proj and gate_up_proj. Greedy tokens and logprobs through the engine (chunked prefill,
prefix caching, preemption; TP=2 over processes), the LongRoPE table against Hugging Face's, the
dummy presets, and what is refused."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from attn_utils import build_metadata
from engine_utils import assert_no_leak
from family_utils import assert_matches_hf, assert_prefix_hits_keep_the_tokens, save_with_tokenizer
from lora_utils import greedy_reference, save_adapter
from safetensors.torch import load_file, save_file
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.attention import get_attn_backend
from pagellm.config.arch import ModelArchConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.layers.rotary import RotaryEmbedding, rope_attention_scale, uses_long_factors
from pagellm.models import get_model_class
from pagellm.worker.loading import build_model, prompt_hidden_states

NEW_TOKENS = 32
VOCAB = 256
HEAD_DIM = 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False, rms_norm_eps=1e-5)
LONGROPE = {"type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)],
            "long_factor": [1.5 + 4.0 * i for i in range(HEAD_DIM // 2)]}
CASES = {
    # (config, the engine's max_model_len)
    "rope": (dict(original_max_position_embeddings=512), 256),
    # Served within its original 128 positions: the short factors, with the attention factor of
    # 512 / 128 positions, as Hugging Face on sequences of up to 128 tokens.
    "longrope-short": (dict(original_max_position_embeddings=128, rope_scaling=LONGROPE), 128),
    # Served beyond its original 16 positions: the long factors, as Hugging Face on every test
    # sequence (all longer than 16 tokens).
    "longrope-long": (dict(original_max_position_embeddings=16, rope_scaling=LONGROPE), 256),
}
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((5, 17, 33, 40))]
SHARED_PREFIX = [(11 * j) % 250 + 3 for j in range(40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
CPU = dict(device="cpu", dtype="float32", kv_cache_memory_bytes=4 << 20)


def hf_model(case: str) -> transformers.Phi3ForCausalLM:
    # A copy: Phi3Config writes into the rope_scaling dict it is given.
    config = transformers.Phi3Config(architectures=["Phi3ForCausalLM"], **COMMON, **copy.deepcopy(CASES[case][0]))
    torch.manual_seed(sorted(CASES).index(case))
    model = transformers.Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in name else p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request, tmp_path_factory):
    """(case, its folder, its Hugging Face model, the engine's max_model_len)."""
    folder = tmp_path_factory.mktemp(request.param)
    model = hf_model(request.param)
    save_with_tokenizer(model, folder)
    return request.param, folder, model, CASES[request.param][1]


def run(folder: Path, prompts: list[list[int]], **kwargs) -> tuple[list, LLM]:
    llm = LLM(str(folder), **{**CPU, **kwargs})
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False), llm


def prefix_prompts() -> list[list[int]]:
    return [SHARED_PREFIX + [5 + i, 9 + i] for i in range(3)]


def test_checkpoints_store_fused_projections(tiny):
    _, folder, _, _ = tiny
    names = load_file(folder / "model.safetensors").keys()
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(".q_proj." in n or ".gate_proj." in n for n in names)


@pytest.mark.parametrize("variant", ["batch", "chunked", "preempted"])
def test_greedy_tokens_and_logprobs_match_hf(tiny, variant):
    _, folder, model, max_model_len = tiny
    kwargs = {"batch": {},
              "chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
              # 12 blocks of 16 tokens for four sequences needing 17: the latest admitted is preempted.
              "preempted": {"num_gpu_blocks_override": 12, "max_model_len": 128, "enable_prefix_caching": False},
              }[variant]
    outs, llm = run(folder, PROMPTS, **{"max_model_len": max_model_len, **kwargs})
    assert_matches_hf(model, outs, PROMPTS, NEW_TOKENS)
    if variant == "preempted":
        assert llm.llm_engine.engine_core.stats().num_preemptions > 0
    assert_no_leak(llm.llm_engine)


def test_prefix_cache_hits_keep_the_tokens(tiny):
    _, folder, model, max_model_len = tiny
    assert_prefix_hits_keep_the_tokens(folder, model, prefix_prompts(), 2 * 32, GREEDY, NEW_TOKENS,
                                       max_model_len=max_model_len, **CPU)


@pytest.mark.slow  # two rank processes (each starts Python and imports torch): tens of seconds
def test_tensor_parallel_over_processes_matches_hf(tiny):
    """Each rank holds its heads' rows of q, k and v and its slice of gate and up, split out of the
    fused tensors before sharding."""
    _, folder, model, max_model_len = tiny
    prompts = PROMPTS + prefix_prompts()
    outs, llm = run(folder, prompts, max_model_len=max_model_len, max_num_batched_tokens=32, max_num_seqs=4,
                    tensor_parallel_size=2)
    try:
        assert_matches_hf(model, outs, prompts, NEW_TOKENS)
    finally:
        llm.llm_engine.shutdown()


def _our_model(hf, max_model_len: int | None = None):
    config = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    config.max_model_len = max_model_len
    model = get_model_class(config.architecture)(config, get_attn_backend("torch"))
    assert model.load_weights(hf.state_dict().items()) == {name for name, _ in model.named_parameters()}
    return model


def _logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens)),
                                          build_metadata([(0, len(tokens), [0, 1, 2])], 16)))


def test_the_longrope_factors_follow_max_model_len():
    """Hugging Face picks the long factors for a sequence beyond the original context; the engine
    picks them when it serves beyond it (for every sequence), and the choice shows in the logits."""
    hf = hf_model("longrope-long")
    tokens = PROMPTS[3]  # 40 tokens, beyond the original 16
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(_logits(_our_model(hf), tokens), expected, atol=1e-4, rtol=1e-4)
    short = _logits(_our_model(hf, max_model_len=16), tokens)
    assert (short - expected).abs().max() > 1e-2
    scaling = ModelArchConfig.from_hf_dict(hf.config.to_dict()).rope_scaling
    assert [uses_long_factors(scaling, 512, n) for n in (None, 17, 16)] == [True, True, False]
    assert ModelArchConfig.from_hf_dict(hf_model("longrope-short").config.to_dict()).rope_scaling[
        "original_max_position_embeddings"] == 128


@pytest.mark.parametrize("case", ["longrope-short", "longrope-long"])
def test_rotary_table_is_hugging_faces(case):
    """cos and sin, the attention factor included, at every position Hugging Face computes them for
    a sequence of the case's test lengths."""
    hf = hf_model(case)
    config = ModelArchConfig.from_hf_dict(hf.config.to_dict())
    config.max_model_len = CASES[case][1]
    ours = RotaryEmbedding(HEAD_DIM, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
                           config.max_model_len).cos_sin_cache
    length = 72 if case == "longrope-short" else 100
    cos, sin = Phi3RotaryEmbedding(hf.config)(torch.zeros(1), torch.arange(length)[None])
    half = HEAD_DIM // 2
    torch.testing.assert_close(ours[:length, :half], cos[0, :, :half], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[:length, half:], sin[0, :, :half], atol=1e-6, rtol=1e-6)
    assert cos[0, 0, 0] > 1.0, "the attention factor applies"


def test_phi3_su_configs_and_the_top_level_original_context():
    """Phi-3's first checkpoints name LongRoPE "su" and keep original_max_position_embeddings
    outside rope_scaling."""
    d = {**COMMON, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 64,
         "rope_scaling": {**LONGROPE, "type": "su"}}
    config = ModelArchConfig.from_hf_dict(d)
    assert config.rope_scaling["original_max_position_embeddings"] == 64
    table = RotaryEmbedding(HEAD_DIM, 512, 10000.0, config.rope_scaling, 64).cos_sin_cache
    assert table[0, 0].item() == pytest.approx((1 + torch.log(torch.tensor(8.0)) / torch.log(torch.tensor(64.0))).sqrt()
                                              .item())


def test_dummy_presets_resolve():
    for preset, long in (("microsoft/Phi-3-mini-4k-instruct", False), ("microsoft/Phi-3.5-mini-instruct", True)):
        config = EngineArgs(preset, load_format="dummy", device="cpu").create_engine_config()
        arch = config.model.source.arch
        assert arch.architecture == "Phi3ForCausalLM" and arch.head_dim == 96
        assert arch.max_model_len == config.model.max_model_len
        if long:
            assert uses_long_factors(arch.rope_scaling, arch.max_position_embeddings, arch.max_model_len)
            short = EngineArgs(preset, load_format="dummy", device="cpu", max_model_len=4096).create_engine_config()
            assert not uses_long_factors(arch.rope_scaling, arch.max_position_embeddings,
                                         short.model.source.arch.max_model_len)


def test_the_sliding_window_is_applied_as_hugging_face_does(tmp_path):
    """Prompts and continuations past a window of 12 tokens (as Phi-3-mini-4k's 2047 on every layer)."""
    hf = hf_model("rope")
    hf.config.sliding_window = 12
    save_with_tokenizer(hf, tmp_path)
    outs, llm = run(tmp_path, PROMPTS, max_model_len=256, max_num_batched_tokens=8, max_num_seqs=4)
    assert llm.llm_engine.config.model.source.arch.sliding_windows == (12,) * COMMON["num_hidden_layers"]
    assert_matches_hf(hf, outs, PROMPTS, NEW_TOKENS)
    assert_no_leak(llm.llm_engine)


def test_adapters_of_the_unfused_projections_are_served(phi3_dir, tmp_path):
    base = hf_model("rope")
    served = save_adapter(base, tmp_path / "served", r=8, alpha=16, targets=["o_proj", "down_proj"], seed=1)
    save_adapter(base, tmp_path / "fused", r=8, alpha=16, targets=["qkv_proj"], seed=2)
    llm = LLM(str(phi3_dir), max_model_len=256, enable_lora=True, max_lora_rank=8, **CPU)
    prompt = PROMPTS[2]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False,
                       lora_request=LoRARequest("served", 1, str(tmp_path / "served")))[0]
    assert out.outputs[0].token_ids == greedy_reference(served, prompt, 8)[0]
    with pytest.raises(ValueError, match="qkv_proj is not an adaptable module"):
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False,
                     lora_request=LoRARequest("fused", 2, str(tmp_path / "fused")))


def _rewrite(src: Path, dst: Path, config_change=None, tensors_change=None) -> str:
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_change(config) if config_change else config))
    (dst / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    tensors = load_file(src / "model.safetensors")
    save_file(tensors_change(tensors) if tensors_change else tensors, dst / "model.safetensors")
    return str(dst)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("phi3")
    save_with_tokenizer(hf_model("rope"), folder)
    return folder


def test_what_is_refused(phi3_dir, tmp_path):
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    short = _rewrite(phi3_dir, tmp_path / "short", tensors_change=lambda t: {**t, qkv: t[qkv][:-16]})
    with pytest.raises(ValueError, match=rf"'{qkv}' has 112 rows, expected 64 \+ 32 \+ 32"):
        LLM(short, **CPU)
    missing = _rewrite(phi3_dir, tmp_path / "missing",
                       tensors_change=lambda t: {k: v for k, v in t.items() if k != qkv})
    with pytest.raises(ValueError, match=rf"lacks 1 tensor\(s\): {qkv}$"):
        LLM(missing, **CPU)
    quantized = _rewrite(phi3_dir, tmp_path / "quantized",
                         tensors_change=lambda t: {**t, qkv.replace("weight", "qweight"): t[qkv].to(torch.int32)})
    with pytest.raises(ValueError, match="a quantized fused projection of Phi-3 is not supported"):
        LLM(quantized, **CPU)
    partial = _rewrite(phi3_dir, tmp_path / "partial", config_change=lambda c: {**c, "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 .* is not supported"):
        LLM(partial, **CPU)


GGUF_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
              "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path: str, model, qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> None:
    """`model` as llama.cpp's converter writes a Phi-3 (arch phi3): q/k/v fused in attn_qkv, gate and
    up in ffn_up, LongRoPE's factors as rope_factors_long / _short tensors beside its original context
    and attention factor; the projections' blocks of `qtype`."""
    config = model.config
    rope = config.rope_parameters
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_name("tiny phi3")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    if rope["rope_type"] == "longrope":
        scaling = ModelArchConfig.from_hf_dict(config.to_dict()).rope_scaling
        writer.add_rope_scaling_attn_factors(rope_attention_scale(scaling, config.max_position_embeddings))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    for name, tensor in model.state_dict().items():
        data = tensor.numpy()
        if name in top:
            writer.add_tensor(top[name], data)
            continue
        _, _, layer, rest = name.split(".", 3)
        module, _, suffix = rest.rpartition(".")
        if module in ("self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.o_proj", "mlp.down_proj"):
            data = gguf.quants.quantize(data, qtype)
            writer.add_tensor(f"blk.{layer}.{GGUF_LAYER[module]}.{suffix}", data, raw_dtype=qtype)
        else:
            writer.add_tensor(f"blk.{layer}.{GGUF_LAYER[module]}.{suffix}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_files_match_hf(case, tmp_path):
    """llama.cpp's phi3 files: fused tensors split as the safetensors', LongRoPE from the file."""
    hf = hf_model(case)
    path = str(tmp_path / "phi3.gguf")
    write_gguf(path, hf)
    config = EngineArgs(path, device="cpu", dtype="float32", max_model_len=CASES[case][1]).create_engine_config()
    assert config.model.source.arch.architecture == "Phi3ForCausalLM"
    model = build_model(config.model.source, config.model.quantization, torch.float32, torch.device("cpu"), "torch", 0)
    tokens = PROMPTS[3]
    with torch.no_grad():
        ours = model.compute_logits(prompt_hidden_states(model, tokens))
        torch.testing.assert_close(ours, hf(torch.tensor([tokens])).logits[0], atol=1e-4, rtol=1e-4)


def test_gguf_blocks_kept_quantized_split_by_rows(tmp_path):
    """Q8_0 blocks of the fused projections kept as blocks on the CPU, each part's rows its own:
    the logits are those of the same blocks dequantized at load (up to the kernels' rounding)."""
    hf = hf_model("longrope-long")
    path = str(tmp_path / "phi3-q8.gguf")
    write_gguf(path, hf, gguf.GGMLQuantizationType.Q8_0)
    logits = {}
    for quantization in ("gguf", "none"):
        config = EngineArgs(path, device="cpu", dtype="float32", quantization=quantization).create_engine_config()
        model = build_model(config.model.source, config.model.quantization, torch.float32, torch.device("cpu"),
                            "torch", 0)
        kept = type(model.model.layers[0].self_attn.qkv_proj.quant_method).__name__
        assert kept == ("GGUFLinearMethod" if quantization == "gguf" else "UnquantizedLinearMethod")
        with torch.no_grad():
            logits[quantization] = model.compute_logits(prompt_hidden_states(model, PROMPTS[3]))
    torch.testing.assert_close(logits["gguf"], logits["none"], atol=2e-2, rtol=2e-2)
