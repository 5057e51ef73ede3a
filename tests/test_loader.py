"""Model sources and weights against Hugging Face: the bundled GGUF, saved safetensors, presets."""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagellm.loader import (
    LOAD_FORMATS,
    PRESETS,
    ModelSource,
    default_model_path,
    initialize_dummy_weights,
    iter_weights,
    resolve_model,
)
from pagellm.loader.gguf_loader import unpermute_rotary_rows


@pytest.mark.slow
def test_default_model_path(smollm2_path: str) -> None:
    assert smollm2_path == default_model_path()
    assert os.path.basename(smollm2_path) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    source = resolve_model(None)
    assert (source.path, source.load_format) == (smollm2_path, "gguf")
    # A folder holding exactly one .gguf resolves to that file.
    assert resolve_model(os.path.dirname(smollm2_path)).path == smollm2_path


@pytest.mark.slow
def test_gguf_config_matches_hf(smollm2_path: str, hf_smollm2_model) -> None:
    arch = resolve_model(smollm2_path).arch
    hf = hf_smollm2_model.config
    assert arch.architecture == "LlamaForCausalLM" == type(hf_smollm2_model).__name__
    assert arch.num_hidden_layers == hf.num_hidden_layers == 30
    assert arch.num_attention_heads == hf.num_attention_heads == 9
    assert arch.num_key_value_heads == hf.num_key_value_heads == 3
    assert arch.head_dim == hf.head_dim == 64
    assert arch.hidden_size == hf.hidden_size == 576
    assert arch.intermediate_size == hf.intermediate_size == 1536
    assert arch.vocab_size == hf.vocab_size == 49152
    assert arch.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert arch.rms_norm_eps == hf.rms_norm_eps
    assert arch.max_position_embeddings == hf.max_position_embeddings == 8192
    assert arch.tie_word_embeddings is hf.tie_word_embeddings is True
    assert arch.rope_scaling is None
    assert arch.bos_token_id == hf.bos_token_id == 1
    assert arch.eos_token_ids == [hf.eos_token_id] == [2]
    assert resolve_model(smollm2_path).generation_config["eos_token_id"] == hf_smollm2_model.generation_config.eos_token_id


@pytest.mark.slow
def test_gguf_weights_match_hf_exactly(smollm2_path: str, hf_smollm2_model) -> None:
    expected = hf_smollm2_model.state_dict()
    seen = set()
    for name, tensor in iter_weights(resolve_model(smollm2_path)):
        assert name in expected, name
        assert name not in seen, name
        seen.add(name)
        assert tensor.dtype == torch.float32 and tensor.device.type == "cpu"
        assert tensor.shape == expected[name].shape, name
        assert torch.equal(tensor, expected[name]), name
    # The head is tied to the embedding, so the file (and we) store it only once.
    assert set(expected) - seen == {"lm_head.weight"}
    assert "model.layers.29.self_attn.k_proj.weight" in seen


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp's converter: per head, rows (first half, second half) become interleaved pairs.
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary_rows(permuted, heads), w)


def _tiny_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                  eos_token_id=2)
    if kind == "llama":
        return LlamaConfig(**common, tie_word_embeddings=True, rope_theta=50000.0, rms_norm_eps=1e-5)
    return Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_safetensors_sharded_roundtrip(kind: str, tmp_path, smollm2_path: str) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(kind), dtype=torch.bfloat16)
    model.generation_config.eos_token_id = [2, 7]
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    source = resolve_model(str(tmp_path))
    assert source.load_format == "safetensors"
    assert source.arch.architecture == ("LlamaForCausalLM" if kind == "llama" else "Qwen2ForCausalLM")
    assert (source.arch.num_hidden_layers, source.arch.num_key_value_heads, source.arch.head_dim) == (3, 2, 16)
    assert source.arch.tie_word_embeddings is (kind == "llama")
    assert source.arch.torch_dtype == "bfloat16"
    assert source.generation_config["eos_token_id"] == [2, 7]

    expected = model.state_dict()
    loaded = dict(iter_weights(source))
    stored = set(expected) - ({"lm_head.weight"} if kind == "llama" else set())
    assert set(loaded) == stored
    for name, tensor in loaded.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, expected[name]), name
    if kind == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in loaded

    # Without the index file every *.safetensors in the folder is read.
    os.remove(tmp_path / "model.safetensors.index.json")
    assert set(dict(iter_weights(resolve_model(str(tmp_path))))) == stored


@pytest.mark.slow
def test_explicit_formats(tmp_path, smollm2_path: str) -> None:
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(_tiny_config("llama")).save_pretrained(tmp_path)
    assert resolve_model(str(tmp_path), "safetensors").load_format == "safetensors"
    dummy = resolve_model(str(tmp_path), "dummy")
    assert dummy.load_format == "dummy" and dummy.arch.hidden_size == 64
    with pytest.raises(ValueError, match="no weights"):
        list(iter_weights(dummy))
    with pytest.raises(ValueError, match="load_format 'gguf'"):
        resolve_model(str(tmp_path), "gguf")
    with pytest.raises(ValueError, match="'safetensors'"):
        resolve_model(smollm2_path, "safetensors")
    assert resolve_model(smollm2_path, "gguf").load_format == "gguf"
    assert resolve_model(smollm2_path, "dummy").load_format == "dummy"


@pytest.mark.parametrize("name, settings, method", [
    ("quantize_config.json", {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "gptq"),  # AutoGPTQ
    ("quant_config.json", {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}, "awq"),  # AutoAWQ
    ("quantize_config.json", {"quant_method": "awq", "bits": 4, "group_size": 64}, "awq")])
def test_quantization_settings_beside_config_json(tmp_path, name: str, settings: dict, method: str) -> None:
    """Checkpoints older than transformers' quantization_config keep it in a file of their own."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(_tiny_config("llama")).save_pretrained(tmp_path)
    assert "quantization_config" not in resolve_model(str(tmp_path)).arch.hf_config
    (tmp_path / name).write_text(json.dumps(settings))
    assert resolve_model(str(tmp_path)).arch.hf_config["quantization_config"] == {**settings, "quant_method": method}


def test_errors_name_the_field(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="nope.*not found.*download"):
        resolve_model(missing)
    with pytest.raises(ValueError, match="load_format 'fp8'"):
        resolve_model(None, load_format="fp8")
    with pytest.raises(ValueError, match="not found"):
        resolve_model("meta-llama/Llama-3.1-8B-Instruct")  # a preset needs load_format="dummy"
    with pytest.raises(ValueError, match="neither a local path nor a preset"):
        resolve_model("no/such-model", load_format="dummy")

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-8b"]))
    with pytest.raises(ValueError, match="--load-format dummy"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), "dummy").arch.num_hidden_layers == 36

    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))
    (tmp_path / "a.gguf").write_bytes(b"GGUF")
    (tmp_path / "b.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="several .gguf"):
        resolve_model(str(tmp_path), "gguf")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        resolve_model(str(tmp_path / "a.gguf"))
    (tmp_path / "c.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="bad magic"):
        resolve_model(str(tmp_path / "c.gguf"))
    assert "dummy" in LOAD_FORMATS


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", ("LlamaForCausalLM", 4096, 32, 32, 8, 128, 14336, 128256)),
        ("llama-3.1-8b", ("LlamaForCausalLM", 4096, 32, 32, 8, 128, 14336, 128256)),
        ("Qwen/Qwen2.5-7B-Instruct", ("Qwen2ForCausalLM", 3584, 28, 28, 4, 128, 18944, 152064)),
        ("qwen2.5-7b", ("Qwen2ForCausalLM", 3584, 28, 28, 4, 128, 18944, 152064)),
        ("Qwen/Qwen3-8B", ("Qwen3ForCausalLM", 4096, 36, 32, 8, 128, 12288, 151936)),
    ],
)
def test_presets(name: str, expected) -> None:
    source = resolve_model(name, load_format="dummy")
    a = source.arch
    assert source.load_format == "dummy" and source.path == name
    assert (a.architecture, a.hidden_size, a.num_hidden_layers, a.num_attention_heads, a.num_key_value_heads,
            a.head_dim, a.intermediate_size, a.vocab_size) == expected
    assert a.torch_dtype == "bfloat16"
    assert a.tie_word_embeddings is False
    assert source.generation_config["eos_token_id"]


def test_llama_preset_rope_and_tokens() -> None:
    a = resolve_model("meta-llama/Llama-3.1-8B-Instruct", "dummy").arch
    assert a.rope_theta == 500000.0 and a.max_position_embeddings == 131072
    assert a.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}
    assert a.bos_token_id == 128000 and a.eos_token_ids == [128001, 128008, 128009]
    q = resolve_model("qwen2.5-7b", "dummy").arch
    assert (q.rope_theta, q.max_position_embeddings, q.rms_norm_eps, q.eos_token_ids) == (1e6, 32768, 1e-6, [151645])
    q3 = resolve_model("qwen3-8b", "dummy").arch
    assert (q3.rope_theta, q3.max_position_embeddings) == (1e6, 40960)
    # A preset handed out twice must not share mutable state.
    a.hf_config["rope_scaling"]["factor"] = 99.0
    assert resolve_model("llama-3.1-8b", "dummy").arch.rope_scaling["factor"] == 8.0


class _TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.proj = torch.nn.Linear(16, 32)
        self.input_layernorm = torch.nn.Parameter(torch.zeros(16))
        self.scale = torch.nn.Parameter(torch.zeros(4))  # 1-D but not a norm


def test_initialize_dummy_weights() -> None:
    def snapshot(seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        net = _TinyNet().to(dtype)
        initialize_dummy_weights(net, seed)
        return {k: v.detach().clone() for k, v in net.state_dict().items()}

    a, b, c = snapshot(0), snapshot(0), snapshot(1)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert torch.equal(a["input_layernorm"], torch.ones(16))
    for name in ("embed.weight", "proj.weight", "proj.bias", "scale"):
        assert not torch.equal(a[name], c[name]), name
        assert a[name].abs().max() <= 1e-3 and a[name].std() > 1e-4, name
    # Distinct parameters get distinct streams, and low precision stays finite.
    assert not torch.equal(a["proj.weight"][:4, :4], a["embed.weight"][:4, :4])
    half = snapshot(0, torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 and torch.isfinite(t).all() for t in half.values())


def test_model_source_is_slotted() -> None:
    source = resolve_model("qwen3-8b", "dummy")
    assert isinstance(source, ModelSource)
    with pytest.raises(AttributeError):
        source.unknown = 1  # type: ignore[attr-defined]


_HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{suffix}"


def _write_qwen3_gguf(path: str, extra_tensor: str | None = None) -> dict[str, torch.Tensor]:
    """A tiny random Qwen3 written the way llama.cpp lays it out (F16 linears, F32 norms, no q/k permutation)."""
    import gguf
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)
    state = AutoModelForCausalLM.from_config(config).state_dict()
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_block_count(2)
    writer.add_context_length(512)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(48)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(16)
    writer.add_value_length(16)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(128)
    writer.add_eos_token_id(5)
    expected = {}
    for name, tensor in state.items():
        array = tensor.numpy() if tensor.dim() == 1 else tensor.numpy().astype("float16")
        writer.add_tensor(_gguf_name(name), array)
        expected[name] = torch.from_numpy(array.astype("float32"))
    if extra_tensor is not None:
        writer.add_tensor(extra_tensor, torch.ones(8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


def test_qwen3_gguf_written_by_gguf_writer(tmp_path) -> None:
    path = str(tmp_path / "tiny-qwen3.gguf")
    expected = _write_qwen3_gguf(path)
    source = resolve_model(path)
    a = source.arch
    assert (a.architecture, a.head_dim, a.num_key_value_heads, a.tie_word_embeddings) == ("Qwen3ForCausalLM", 16, 2, False)
    assert (a.rope_theta, a.max_position_embeddings, a.eos_token_ids) == (1e6, 512, [5])
    loaded = dict(iter_weights(source))
    assert set(loaded) == set(expected)
    assert "model.layers.1.self_attn.k_norm.weight" in loaded and "lm_head.weight" in loaded
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.mark.parametrize(("extra", "match"), [("rope_freqs.weight", "rope_freqs"), ("blk.0.mystery.weight", "mystery")])
def test_gguf_unsupported_tensors(tmp_path, extra: str, match: str) -> None:
    path = str(tmp_path / "odd.gguf")
    _write_qwen3_gguf(path, extra_tensor=extra)
    with pytest.raises(ValueError, match=match):
        list(iter_weights(resolve_model(path)))
