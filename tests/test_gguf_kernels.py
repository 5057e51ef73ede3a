"""The GGUF CPU kernels and the quantization seam: products against a PyTorch reference, exact
dequantization, which layers stay quantized, and the --quantization flag's errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from pagellm.engine.arg_utils import EngineArgs
from pagellm.ops.c import build as native
from pagellm.quantization import resolve_quantization
from pagellm.ops.c import ggml as ggml_cpu
from pagellm.quantization.gguf import GGUFConfig, GGUFLinearMethod

pytestmark = pytest.mark.skipif(ggml_cpu.unavailable_reason() is not None,
                                reason=str(ggml_cpu.unavailable_reason()))
QTYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def blocks(qtype: Q, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights quantized by the gguf package: (raw blocks, their float32 values)."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    raw = gguf_quantize(w, qtype)
    return torch.from_numpy(raw), torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m, k, n", [(1, 32, 1), (1, 576, 40), (2, 64, 7), (3, 1536, 33), (7, 96, 5), (9, 576, 64)])
def test_gemm_is_the_product_with_the_dequantized_weight(qtype, m, k, n):
    raw, values = blocks(qtype, n, k, seed=m * k + n)
    x = torch.randn(m, k) * torch.logspace(-2, 2, k)  # uneven magnitudes, like real activations
    got = ggml_cpu.gemm(int(qtype), x, raw, n)
    expected = x.double() @ values.double().T
    # float32 sums of k products: relative error ~ k * 2**-24 of the terms' magnitude.
    scale = (x.abs().double() @ values.abs().double().T).max().item()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=4 * k * 2**-24 * scale)


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda q: q.name)
def test_dequantize_gives_the_files_exact_values(qtype):
    raw, values = blocks(qtype, 5, 96, seed=1)
    assert torch.equal(ggml_cpu.dequantize(int(qtype), raw, 96), values)


@pytest.mark.parametrize("rows", [2, 3, 5, 8, 9, 70])
def test_a_rows_result_does_not_depend_on_its_batch(rows):
    """Bit for bit: a row is summed in the same order whatever the batch (tiles of 4, 2 and 1 rows,
    chunks of 64)."""
    raw, _ = blocks(Q.Q4_1, 48, 192, seed=2)
    layer = torch.nn.Module()
    method = GGUFLinearMethod(int(Q.Q4_1))
    layer.weight_loader = None
    method.create_weights(layer, 192, 48)
    layer.weight.data.copy_(raw)
    x = torch.randn(rows, 192)
    batch = method.apply(layer, x, None)
    for row in (0, rows - 1):
        assert torch.equal(batch[row:row + 1], method.apply(layer, x[row:row + 1], None))


@pytest.mark.slow
def test_smollm2_keeps_its_blocks_and_ties_the_head(smollm2_path):
    from pagellm.models import get_model_class
    from pagellm.attention import get_attn_backend
    from pagellm.loader import resolve_model

    arch = resolve_model(smollm2_path).arch
    model = get_model_class(arch.architecture)(arch, get_attn_backend("torch"))
    kept = GGUFConfig.from_file(smollm2_path).apply(model)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, GGUFLinearMethod) and qkv.quant_method.qtype == Q.Q4_1
    assert qkv.weight.dtype == torch.uint8 and qkv.weight.shape == (576 + 2 * 192, 576 // 32 * 20)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, Q8_0 blocks
    assert model.model.embed_tokens.quant_method.qtype == Q.Q8_0
    assert {"model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"} <= kept
    assert not any("norm" in name for name in kept)


@pytest.mark.slow
def test_quantization_flag_errors_name_the_flag(smollm2_path, tmp_path, monkeypatch):
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match=r"--quantization\) must be one of .*gguf.*, none, got .fp4."):
        EngineArgs(quantization="fp4").validate()
    with pytest.raises(ValueError, match=r"'gguf' needs a .gguf model"):
        resolve_quantization("gguf", "safetensors", str(tmp_path), cpu)
    for requested in ("gguf", None):  # the GPU keeps the blocks (the Triton kernel)
        assert resolve_quantization(requested, "gguf", smollm2_path, torch.device("cuda")) == "gguf"
    assert resolve_quantization(None, "gguf", smollm2_path, cpu) == "gguf"
    assert resolve_quantization("none", "gguf", smollm2_path, cpu) is None
    assert resolve_quantization(None, "safetensors", str(tmp_path), cpu) is None
    # Without a compiler: the default falls back to dequantizing (with a warning), the flag fails.
    monkeypatch.setattr(native, "compiler", lambda: None)
    assert resolve_quantization(None, "gguf", smollm2_path, cpu) is None
    with pytest.raises(ValueError, match="no C compiler"):
        resolve_quantization("gguf", "gguf", smollm2_path, cpu)
