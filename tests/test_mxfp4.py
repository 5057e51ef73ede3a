"""MXFP4 dequantization (GPT-OSS's expert weights) against a reference written from the OCP
Microscaling Formats v1.0 spec and against transformers' own, the checkpoint stream that pairs
blocks with scales, and GPT-OSS's experts loaded from such a checkpoint."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from pagellm.config.arch import ModelArchConfig
from pagellm.config.model import ModelSource
from pagellm.layers.moe import STACKED, FusedMoE
from pagellm.loader import iter_weights
from pagellm.loader.mxfp4 import dequantize_mxfp4, iter_mxfp4_dequantized


def e2m1(code: int) -> float:
    """OCP MX v1.0, FP4 E2M1: 1 sign bit, 2 exponent bits of bias 1, 1 mantissa bit; exponent 0
    is subnormal (no implicit one)."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return sign * magnitude


def e8m0(bits: int) -> float:
    """OCP MX v1.0, E8M0: an unsigned exponent of bias 127; all ones is NaN."""
    return math.nan if bits == 0xFF else 2.0 ** (bits - 127)


def reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Element by element: each byte's low nibble first (GPT-OSS's packing), times its block's scale."""
    rows = []
    for block, scale in zip(blocks.reshape(-1, 16).tolist(), scales.reshape(-1).tolist()):
        rows.append([e2m1(code) * e8m0(scale) for byte in block for code in (byte & 0x0F, byte >> 4)])
    return torch.tensor(rows, dtype=torch.float64).reshape(*scales.shape[:-1], scales.shape[-1] * 32)


def random_mxfp4(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [*shape, 16] and scales [*shape] of every code, scales around 2^0."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(117, 133, shape, generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_matches_the_spec_every_code_and_extreme_scales():
    blocks, scales = random_mxfp4(3, 5, 4)
    blocks[0, 0, 0] = torch.arange(256, dtype=torch.uint8).view(16, 16)[0]  # codes 0-15 in low nibbles
    scales[0, 0, :3] = torch.tensor([0, 254, 0xFF], dtype=torch.uint8)  # 2^-127, 2^127, NaN
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    expected = reference(blocks, scales)
    assert ours.shape == (3, 5, 128)
    assert torch.equal(ours.isnan(), expected.isnan()) and ours[0, 0, 64:96].isnan().all()
    finite = ~expected.isnan() & expected.abs().lt(3e38)
    assert torch.equal(ours[finite].double(), expected[finite])
    assert sorted(set(ours[0, 0, 0:32:2].tolist())) == sorted(set(e2m1(c) * 2.0**-127 for c in range(16)))


def test_bfloat16_holds_every_value_exactly():
    blocks, scales = random_mxfp4(4, 6, 2, seed=1)
    assert torch.equal(dequantize_mxfp4(blocks, scales).float(), dequantize_mxfp4(blocks, scales, torch.float32))


def test_matches_transformers_dequantization():
    """transformers' GPT-OSS dequantization gives the same bfloat16 values, in its layout
    (transposed, [experts, in, out]) as the checkpoint stream yields them."""
    blocks, scales = random_mxfp4(3, 10, 4, seed=2)  # 3 experts, 10 rows, 4 blocks of 32 inputs
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    (name, ours), = iter_mxfp4_dequantized([("gate_up_proj_blocks", blocks), ("gate_up_proj_scales", scales)])
    assert name == "gate_up_proj" and ours.shape == theirs.shape == (3, 128, 10)
    assert torch.equal(ours, theirs)


def test_the_stream_pairs_blocks_with_scales_in_any_order():
    blocks, scales = random_mxfp4(2, 3, 1)
    other = torch.ones(3)
    stream = [("a_scales", scales), ("norm", other), ("a_blocks", blocks), ("b_blocks", blocks), ("b_scales", scales)]
    out = dict(iter_mxfp4_dequantized(stream))
    assert list(out) == ["norm", "a", "b"] and out["norm"] is other
    assert torch.equal(out["a"], out["b"]) and out["a"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="holds c_blocks without its _blocks / _scales counterpart"):
        list(iter_mxfp4_dequantized([("c_blocks", blocks)]))
    with pytest.raises(ValueError, match="'d': MXFP4 blocks .* must match their scales"):
        list(iter_mxfp4_dequantized([("d_blocks", blocks), ("d_scales", scales[..., :0])]))
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.int(), scales)


def test_gpt_oss_experts_load_from_an_mxfp4_checkpoint(tmp_path):
    """A GPT-OSS layer's experts stored as MXFP4 (gate/up rows interleaved) with bfloat16 biases: the
    safetensors stream dequantizes them, the experts load them, and compute what transformers'
    GptOssExperts computes with its own dequantization of the same tensors."""
    experts, inter, hidden = 4, 32, 64
    gate_up_blocks, gate_up_scales = random_mxfp4(experts, 2 * inter, hidden // 32, seed=3)
    down_blocks, down_scales = random_mxfp4(experts, hidden, inter // 32, seed=4)
    gen = torch.Generator().manual_seed(5)
    prefix = "model.layers.0.mlp.experts."
    tensors = {prefix + "gate_up_proj_blocks": gate_up_blocks, prefix + "gate_up_proj_scales": gate_up_scales,
               prefix + "gate_up_proj_bias": torch.randn(experts, 2 * inter, generator=gen).bfloat16(),
               prefix + "down_proj_blocks": down_blocks, prefix + "down_proj_scales": down_scales,
               prefix + "down_proj_bias": torch.randn(experts, hidden, generator=gen).bfloat16()}
    save_file(tensors, tmp_path / "model.safetensors")
    config = {"quantization_config": {"quant_method": "mxfp4"}}
    arch = ModelArchConfig("GptOssForCausalLM", 32, hidden, inter, 1, 4, 4, 16, 1e-5, 1e4, 128, hf_config=config)
    weights = dict(iter_weights(ModelSource(str(tmp_path), "safetensors", arch)))
    assert set(weights) == {prefix + p for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}

    moe = FusedMoE(experts, 2, hidden, inter, renormalize=False, scoring="topk_softmax", activation="swigluoai",
                   bias=True)
    for param, name, part in ((moe.w13_weight, "gate_up_proj", "w13_interleaved"),
                              (moe.w13_bias, "gate_up_proj_bias", "w13_interleaved"),
                              (moe.w2_weight, "down_proj", "w2"), (moe.w2_bias, "down_proj_bias", "w2")):
        tensor = weights[prefix + name]
        moe.weight_loader(param, tensor if name.endswith("bias") else tensor.transpose(1, 2), (STACKED, part))

    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    hf_config = transformers.GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                                          num_experts_per_tok=2)
    hf_config._experts_implementation = "eager"
    hf = GptOssExperts(hf_config)
    with torch.no_grad():
        hf.gate_up_proj.copy_(convert_moe_packed_tensors(gate_up_blocks, gate_up_scales))
        hf.down_proj.copy_(convert_moe_packed_tensors(down_blocks, down_scales))
        hf.gate_up_proj_bias.copy_(tensors[prefix + "gate_up_proj_bias"])
        hf.down_proj_bias.copy_(tensors[prefix + "down_proj_bias"])
        x = torch.randn(9, hidden, generator=gen) * 0.05
        logits = torch.randn(9, experts, generator=gen)
        weights, ids = logits.topk(2, dim=-1)
        expected = hf(x, ids, weights.softmax(dim=-1))
    torch.testing.assert_close(moe(x, logits), expected, rtol=1e-4, atol=1e-4)
