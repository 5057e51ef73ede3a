"""GGUF blocks on the GPU: each block type's conversion into the Triton kernel's grouped layout
gives the gguf package's own dequantized values, the kernel multiplies with those layouts (the
interpreter at small sizes on the CPU), and on a GPU a model written by gguf's writer with a mix of
kept types runs on its blocks as it does dequantized at load."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from benchmarks.gguf_gpu import random_blocks, write_synthetic_gguf
from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs
from pagellm.eval.quality import log_probs
from pagellm.quantization import gguf_blocks
from pagellm.worker.loading import build_model

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]


def blocks(qtype: Q, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row]: weights quantized by the gguf package where it can (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0), else random codes and sub-block scales under float16 scales of a sensible size."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        return gguf_quantize((rng.standard_normal((rows, cols)) * 0.05).astype(np.float32), qtype)
    return random_blocks(int(qtype), rows, cols, rng)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_grouped_layout_holds_the_gguf_packages_values(qtype):
    raw = blocks(qtype, 6, 512, seed=int(qtype))
    grouped = gguf_blocks.to_grouped(int(qtype), torch.from_numpy(raw), 512)
    expected = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    assert torch.equal(gguf_blocks.dequantize(grouped), expected)
    assert grouped.codes.shape == ((6, 256) if grouped.codes.dtype == torch.uint8 else (6, 512))
    assert grouped.scale.shape == (6, 512 // grouped.group)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantize_kernel_gives_the_grouped_layouts_values(qtype):
    """What large steps multiply with cuBLAS (`triton_matmul.dequantize_weight`)."""
    pytest.importorskip("triton")
    from pagellm.ops.triton.matmul import dequantize_weight

    g = gguf_blocks.to_grouped(int(qtype), torch.from_numpy(blocks(qtype, 40, 512, seed=3)), 512)
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = dequantize_weight(on(g.codes), on(g.scale), g.zero, g.group, on(g.offset), torch.float32)
    assert torch.equal(got.cpu(), gguf_blocks.dequantize(g))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
# Interpreted: one row and 300 rows run in the quick tier, the others are slow.
@pytest.mark.parametrize("rows", [1, pytest.param(5, marks=pytest.mark.slow), pytest.param(17, marks=pytest.mark.slow),
                                  300])
def test_kernel_multiplies_with_the_grouped_layouts(qtype, rows, monkeypatch):
    pytest.importorskip("triton")
    from pagellm.ops.triton.matmul import DEQUANTIZE_ROWS, dequant_matmul
    from test_quantization import count_dequantized

    dequantized = count_dequantized(monkeypatch)

    n, k = (4096, 4096) if ON_GPU else (24, 512)
    g = gguf_blocks.to_grouped(int(qtype), torch.from_numpy(blocks(qtype, n, k, seed=rows)), k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    expected = x.double() @ gguf_blocks.dequantize(g).double().t()
    on = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = dequant_matmul(x.to(DEVICE), on(g.codes), on(g.scale), g.zero, g.group, on(g.offset)).double().cpu()
    magnitude = (x.abs().double() @ gguf_blocks.dequantize(g).abs().double().t()).max().item()
    torch.testing.assert_close(got, expected, rtol=0, atol=8 * math.sqrt(k) * 2**-24 * magnitude)
    # Into some columns of a wider output (a fused layer's parts of different types), the rest untouched.
    wide = torch.full((rows, n + 5), 7.0, device=DEVICE)
    dequant_matmul(x.to(DEVICE), on(g.codes), on(g.scale), g.zero, g.group, on(g.offset), out=wide[:, 3:3 + n])
    assert torch.equal(wide[:, 3:3 + n].double().cpu(), got) and bool((wide[:, :3] == 7).all())
    assert bool((wide[:, 3 + n:] == 7).all())
    assert bool(dequantized) == (rows >= DEQUANTIZE_ROWS)


# --- a model ---------------------------------------------------------------------------------------

TINY = dict(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
MODEL_TYPES = {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_0, "ffn_gate": Q.Q4_1,
               "ffn_up": Q.Q4_1, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0, "output": Q.Q6_K}


def write_tiny(tmp_path) -> str:
    path = str(tmp_path / "tiny.gguf")
    write_synthetic_gguf(path, TINY, {k: int(v) for k, v in MODEL_TYPES.items()})
    return path


def _load(path: str, quantization: str, device: torch.device) -> torch.nn.Module:
    config = EngineArgs(model=path, device=device.type, dtype="float32",
                        quantization=quantization).create_engine_config()
    return build_model(config.model.source, config.model.quantization, config.model.dtype, device, "torch", 0)


def test_cpu_keeps_only_the_types_its_kernels_take(tmp_path):
    from pagellm.ops.c import ggml as ggml_cpu
    from pagellm.quantization.gguf import GGUFLinearMethod

    if ggml_cpu.unavailable_reason() is not None:
        pytest.skip(ggml_cpu.unavailable_reason())
    path = write_tiny(tmp_path)
    model = _load(path, "gguf", torch.device("cpu"))
    layer = model.model.layers[0]
    kept = {name: isinstance(m.quant_method, GGUFLinearMethod) for name, m in
            (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj), ("gate_up", layer.mlp.gate_up_proj),
             ("down", layer.mlp.down_proj), ("embed", model.model.embed_tokens), ("head", model.lm_head))}
    assert kept == {"qkv": False, "o": True, "gate_up": True, "down": False, "embed": True, "head": False}


@pytest.mark.skipif(not ON_GPU, reason="the GPU keeps Q4_K and Q6_K blocks")
def test_gpu_runs_every_block_type_as_dequantized_at_load(tmp_path):
    from pagellm.quantization.gguf import GGUFLinearMethod

    path = write_tiny(tmp_path)
    gpu = torch.device("cuda")
    blocks, dense = _load(path, "gguf", gpu), _load(path, "none", gpu)
    methods = [m.quant_method for m in blocks.modules() if isinstance(getattr(m, "quant_method", None),
                                                                       GGUFLinearMethod)]
    assert {t for m in methods for t in ((m.qtype,) if m.part_types is None else m.part_types.values())} == \
        {int(q) for q in MODEL_TYPES.values()}
    qkv = blocks.model.layers[0].self_attn.qkv_proj.quant_method  # q and k Q4_K, v Q6_K: two runs
    assert qkv.part_types == {"q": Q.Q4_K, "k": Q.Q4_K, "v": Q.Q6_K}
    assert [(start, rows) for start, rows, _ in qkv.runs] == [(0, 256 + 128), (256 + 128, 128)]
    assert blocks.lm_head.weight.dtype == torch.int8  # Q6_K codes, one a byte
    ids = torch.randint(TINY["vocab_size"], (40,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = log_probs(dense, ids)
    torch.testing.assert_close(log_probs(blocks, ids), expected, atol=1e-3, rtol=0)


def test_synthetic_file_serves_on_the_cpu(tmp_path):
    """The benchmark's 8B-shaped file, tiny: its placeholder vocabulary tokenizes and detokenizes,
    and the engine generates from it (Q4_K and Q6_K dequantized at load on the CPU)."""
    path = str(tmp_path / "synthetic.gguf")
    write_synthetic_gguf(path, TINY)
    llm = LLM(path, device="cpu", dtype="float32")
    out = llm.generate(["t12 t7"], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5 and isinstance(out.outputs[0].text, str)


def test_fused_layer_of_mixed_types_writes_each_run_into_its_columns():
    """A fused layer whose parts differ in type (GPU only in the engine; here its conversion and
    the kernel run on the CPU, in Triton's interpreter): each part's blocks go into its rows of one
    padded buffer, consecutive parts of one type make one run, and each run's product lands in its
    columns of the output."""
    pytest.importorskip("triton")
    from pagellm.layers.linear import QKVParallelLinear
    from pagellm.quantization.gguf import GGUFLinearMethod

    types = {"q": Q.Q4_K, "k": Q.Q4_K, "v": Q.Q6_K}
    layer = QKVParallelLinear(256, 64, 4, 2)  # q 256 rows, k and v 128 each
    layer.set_quant_method(GGUFLinearMethod(None, {shard: int(t) for shard, t in types.items()}))
    dense = []
    for seed, (shard, rows) in enumerate((("q", 256), ("k", 128), ("v", 128))):
        raw = blocks(types[shard], rows, 256, seed)
        layer.weight.weight_loader(layer.weight, torch.from_numpy(raw), shard)
        dense.append(torch.from_numpy(gguf_dequantize(raw, types[shard]).astype(np.float32)))
    assert layer.weight.shape == (512, 256 // 256 * 210)  # as wide as a Q6_K row
    layer.quant_method.convert(layer)
    assert [(start, rows) for start, rows, _ in layer.quant_method.runs] == [(0, 384), (384, 128)]
    assert not hasattr(layer, "weight") and layer.weight_0.dtype == torch.uint8 and layer.weight_1.dtype == torch.int8
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    expected = x.double() @ torch.cat(dense).double().t()
    torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=1e-4 * expected.abs().max().item())
