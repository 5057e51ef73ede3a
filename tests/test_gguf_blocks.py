"""GGUF blocks on the GPU: each block type's conversion into the Triton kernel's grouped layout
gives the gguf package's own dequantized values, the kernel multiplies with those layouts (the
interpreter at small sizes on the CPU), and on a GPU a model written by gguf's writer with every
kept type runs on its blocks as it does dequantized at load."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagellm.config import EngineArgs
from pagellm.eval.quality import log_probs
from pagellm.quantization import gguf_blocks
from pagellm.worker.loading import build_model

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K]


def random_blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row]: weights quantized by the gguf package where it can (Q4_0, Q4_1,
    Q8_0), else random codes and sub-block scales under float16 scales of a sensible size."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        return gguf_quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    values, nbytes = gguf_blocks.BLOCKS[int(qtype)]
    blocks = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)

    def f16(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, (rows, cols // values, 1)).astype(np.float16).view(np.uint8)

    if qtype == Q.Q4_K:  # d, dmin, then 12 bytes of 6-bit scales and minimums, then the codes
        blocks[..., 0:2], blocks[..., 2:4] = f16(1e-4, 3e-4), f16(0, 3e-4)
    else:  # Q6_K: codes, 16 int8 scales, then d
        blocks[..., 208:210] = f16(3e-5, 1e-4)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_grouped_layout_holds_the_gguf_packages_values(qtype):
    raw = random_blocks(qtype, 6, 512, seed=int(qtype))
    grouped = gguf_blocks.to_grouped(int(qtype), torch.from_numpy(raw), 512)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(gguf_blocks.dequantize(grouped), expected)
    assert grouped.codes.shape == ((6, 256) if grouped.codes.dtype == torch.uint8 else (6, 512))
    assert grouped.scale.shape == (6, 512 // grouped.group)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_kernel_multiplies_with_the_grouped_layouts(qtype, rows):
    pytest.importorskip("triton")
    from pagellm.quantization.triton_matmul import dequant_matmul

    n, k = (4096, 4096) if ON_GPU else (24, 512)
    g = gguf_blocks.to_grouped(int(qtype), torch.from_numpy(random_blocks(qtype, n, k, seed=rows)), k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ gguf_blocks.dequantize(g).double().t()
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = dequant_matmul(x.to(DEVICE), on(g.codes), on(g.scale), g.zero, g.group, on(g.offset)).double().cpu()
    magnitude = (x.abs().double() @ gguf_blocks.dequantize(g).abs().double().t()).max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=8 * math.sqrt(k) * 2**-24 * magnitude)


# --- a model ---------------------------------------------------------------------------------------

_LAYER = {"self_attn.q_proj": ("attn_q", Q.Q4_K), "self_attn.k_proj": ("attn_k", Q.Q4_K),
          "self_attn.v_proj": ("attn_v", Q.Q6_K), "self_attn.o_proj": ("attn_output", Q.Q4_0),
          "mlp.gate_proj": ("ffn_gate", Q.Q4_1), "mlp.up_proj": ("ffn_up", Q.Q4_1), "mlp.down_proj": ("ffn_down", Q.Q6_K)}
HIDDEN, FFN, VOCAB = 256, 512, 300


def write_llama_gguf(path: str) -> None:
    """A 2-layer Llama with every GPU block type (the embedding Q8_0, the head Q6_K), F32 norms."""
    import gguf

    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, 2), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_rope_freq_base, 1e4),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, VOCAB)):
        add(value)
    shapes = {"attn_q": HIDDEN, "attn_k": HIDDEN // 2, "attn_v": HIDDEN // 2, "attn_output": HIDDEN,
              "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": HIDDEN}
    seed = 0
    for layer in range(2):
        for name, qtype in _LAYER.values():
            seed += 1
            cols = FFN if name == "ffn_down" else HIDDEN
            writer.add_tensor(f"blk.{layer}.{name}.weight", random_blocks(qtype, shapes[name], cols, seed),
                              raw_dtype=qtype)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.add_tensor("token_embd.weight", random_blocks(Q.Q8_0, VOCAB, HIDDEN, 99), raw_dtype=Q.Q8_0)
    writer.add_tensor("output.weight", random_blocks(Q.Q6_K, VOCAB, HIDDEN, 98), raw_dtype=Q.Q6_K)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _load(path: str, quantization: str, device: torch.device) -> torch.nn.Module:
    config = EngineArgs(model=path, device=device.type, dtype="float32",
                        quantization=quantization).create_engine_config()
    return build_model(config.source, config.quantization, config.dtype, device, "torch", 0)


def test_cpu_keeps_only_the_types_its_kernels_take(tmp_path):
    from pagellm.quantization import ggml_cpu
    from pagellm.quantization.gguf import GGUFLinearMethod

    if ggml_cpu.unavailable_reason() is not None:
        pytest.skip(ggml_cpu.unavailable_reason())
    path = str(tmp_path / "tiny.gguf")
    write_llama_gguf(path)
    model = _load(path, "gguf", torch.device("cpu"))
    layer = model.model.layers[0]
    kept = {name: isinstance(m.quant_method, GGUFLinearMethod) for name, m in
            (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
             ("down", layer.mlp.down_proj), ("embed", model.model.embed_tokens), ("head", model.lm_head))}
    assert kept == {"qkv": False, "o": True, "gate_up": True, "down": False, "embed": True, "head": False}


@pytest.mark.skipif(not ON_GPU, reason="the GPU keeps Q4_K and Q6_K blocks")
def test_gpu_runs_every_block_type_as_dequantized_at_load(tmp_path):
    from pagellm.quantization.gguf import GGUFLinearMethod

    path = str(tmp_path / "tiny.gguf")
    write_llama_gguf(path)
    gpu = torch.device("cuda")
    blocks, dense = _load(path, "gguf", gpu), _load(path, "none", gpu)
    methods = [m.quant_method for m in blocks.modules() if hasattr(m, "quant_method")]
    assert {m.qtype for m in methods if isinstance(m, GGUFLinearMethod)} == {int(q) for q in QTYPES}
    assert blocks.lm_head.weight.dtype == torch.int8  # Q6_K codes, one a byte
    ids = torch.randint(VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = log_probs(dense, ids, gpu)
    torch.testing.assert_close(log_probs(blocks, ids, gpu), expected, atol=1e-3, rtol=0)
