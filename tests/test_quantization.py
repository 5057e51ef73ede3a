"""Quantized weights: the dequantizing Triton kernel against PyTorch, checkpoints written by the real
libraries (compressed-tensors, AutoAWQ) or by a packer of GPTQ's documented layout loaded and run
against Hugging Face on the dequantized weights, the methods that quantize at load, and the errors.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import save_file

from pagellm.engine.arg_utils import EngineArgs
from pagellm.eval.quality import log_probs
from pagellm.quantization import resolve_quantization
from pagellm.quantization.base import Calibration
from pagellm.quantization.int4 import dequantize, pack_pairs, quantize_rtn
from pagellm.quantization.w8a8 import FP8_SCALE_STEPS, SMALL_BATCH_ROWS, quantize_per_row, quantize_weight_rows
from pagellm.worker.loading import build_model, prompt_hidden_states

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
CPU = torch.device("cpu")
TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, architectures=["LlamaForCausalLM"])
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny_hf(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0, 0.2) if "norm" in name else p.normal_(0.0, 0.1)
    return hf


def _load(path: str, **kwargs) -> tuple[torch.nn.Module, str | None]:
    config = EngineArgs(model=path, device="cpu", dtype="float32", **kwargs).create_engine_config()
    model = build_model(config.model.source, config.model.quantization, config.model.dtype, CPU, "torch", 0)
    return model, config.model.quantization


def _assert_matches_hf(model: torch.nn.Module, hf: torch.nn.Module, length: int, atol: float = 1e-4) -> None:
    ids = torch.randint(TINY["vocab_size"], (length,), generator=torch.Generator().manual_seed(length)).tolist()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    torch.testing.assert_close(log_probs(model, ids), expected, atol=atol, rtol=0)


def _write_checkpoint(path, hf: torch.nn.Module, tensors: dict[str, torch.Tensor], quantization_config: dict) -> None:
    """hf's config (plus `quantization_config`) and tensors: hf's own, those in `tensors` replacing or
    adding to them (a projection's dense weight is dropped when its quantized tensors are given)."""
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for name in list(tensors):
        state.pop(name.rsplit(".", 1)[0] + ".weight", None)
    state.update(tensors)
    save_file(state, str(path / "model.safetensors"))
    config = hf.config.to_dict()
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))


def _projections(hf: torch.nn.Module):
    for name, module in hf.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            yield name, module


# --- the kernel ----------------------------------------------------------------------------------------

triton_shapes = [(1, 4096, 4096), (16, 6144, 4096), (17, 4096, 14336), (300, 1024, 4096)] if ON_GPU else \
    [(1, 48, 64), (1, 24, 96), (5, 40, 128), (17, 16, 64), (33, 24, 96), (130, 16, 64), (260, 24, 128)]


def count_dequantized(monkeypatch) -> list[int]:
    """Calls of `triton_matmul.dequantize_weight` from now on (the path of large steps)."""
    from pagellm.ops.triton import matmul as triton_matmul

    calls: list[int] = []
    real = triton_matmul.dequantize_weight
    monkeypatch.setattr(triton_matmul, "dequantize_weight", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
@pytest.mark.parametrize("rows,n,k", triton_shapes)
def test_dequant_matmul_8bit_matches_torch(dtype: torch.dtype, rows: int, n: int, k: int, monkeypatch) -> None:
    pytest.importorskip("triton")
    from pagellm.ops.triton.matmul import DEQUANTIZE_ROWS, dequant_matmul

    dequantized = count_dequantized(monkeypatch)

    gen = torch.Generator().manual_seed(rows + n + k)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    q, scale = quantize_per_row(w, dtype)
    # Triton's interpreter multiplies 16-bit tiles wrongly (it has no bfloat16): float32 only there.
    for x_dtype in (torch.float32, torch.bfloat16) if ON_GPU else (torch.float32,):
        xd = x.to(x_dtype)
        expected = (xd.float() @ q.float().t()) * scale
        got = dequant_matmul(xd.to(DEVICE), q.to(DEVICE), scale.to(DEVICE)).float().cpu()
        tol = 1e-4 if x_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, expected, atol=tol * math.sqrt(k), rtol=tol)
    assert bool(dequantized) == (rows >= DEQUANTIZE_ROWS)


@pytest.mark.parametrize("group", [32, 64, 128, 0])
@pytest.mark.parametrize("rows,n,k", triton_shapes)
def test_dequant_matmul_int4_matches_torch(group: int, rows: int, n: int, k: int, monkeypatch) -> None:
    pytest.importorskip("triton")
    from pagellm.ops.triton.matmul import DEQUANTIZE_ROWS, dequant_matmul

    group = group or k  # 0: one group per output channel
    if k % group:
        pytest.skip("the shape does not split into these groups")
    gen = torch.Generator().manual_seed(rows + n + k + group)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    q, scales, zeros = quantize_rtn(w, group)
    qweight, scales16 = pack_pairs(q), scales.half()
    expected = x @ dequantize(qweight, scales16, zeros, group).t()
    assert (dequantize(qweight, scales16, zeros, group) - w).abs().max() <= scales.max() * 0.51  # rounding only
    dequantized = count_dequantized(monkeypatch)
    got = dequant_matmul(x.to(DEVICE), qweight.to(DEVICE), scales16.to(DEVICE), zeros.to(DEVICE), group).cpu()
    torch.testing.assert_close(got, expected, atol=1e-4 * math.sqrt(k), rtol=1e-4)
    assert bool(dequantized) == (rows >= DEQUANTIZE_ROWS)


def test_one_row_candidates_are_float16_tiles_only_where_float16_products_apply() -> None:
    """Where float16 products apply (4-bit codes, 16-bit activations on a GPU that packs them,
    groups of whole runs of 32 inputs or a scale per channel), the one-row candidates are the float16
    tiles alone; elsewhere (float32 activations, groups of 16, 8-bit codes) none of them, and with
    groups every candidate holds whole groups."""
    from pagellm.ops.triton import matmul as triton_matmul

    def kinds(packed: bool, group: int, float16_products: bool) -> set[bool]:
        configs = triton_matmul._one_row_candidates(packed, group, group > 0, float16_products)
        assert all(group == 0 or c.kwargs["BLOCK_K"] % group == 0 for c in configs)
        return {c.kwargs["HALF"] for c in configs}

    assert kinds(True, 128, True) == {True} and kinds(True, 32, True) == {True} and kinds(True, 0, True) == {True}
    assert kinds(True, 128, False) == {False} and kinds(True, 16, True) == {False}
    assert kinds(False, 0, True) == {False} and kinds(False, 32, True) == {False}


def test_one_row_reads_4bit_codes_as_words_only_where_they_are_whole_words(monkeypatch) -> None:
    """The one-row kernel reads eight codes an int32 word; codes starting mid-word (a view one byte
    into its storage, or rows strided by an odd number of bytes) take the tiled kernel instead, and
    all multiply right."""
    pytest.importorskip("triton")
    from pagellm.ops.triton import matmul as triton_matmul

    n, k, group = 16, 64, 32
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    q, scales, zeros = quantize_rtn(w, group)
    qweight, scales16 = pack_pairs(q), scales.half()
    expected = x @ dequantize(qweight, scales16, zeros, group).t()
    unaligned = torch.empty(n * k // 2 + 1, dtype=torch.uint8, device=DEVICE)[1:].view(n, k // 2)
    unaligned.copy_(qweight)
    odd_rows = torch.zeros(n, k // 2 + 1, dtype=torch.uint8, device=DEVICE)[:, : k // 2]
    odd_rows.copy_(qweight)
    gemv_calls: list[int] = []
    real = triton_matmul._gemv
    monkeypatch.setattr(triton_matmul, "_gemv", lambda *a: gemv_calls.append(1) or real(*a))
    for weight, by_words in ((qweight.to(DEVICE), True), (unaligned, False), (odd_rows, False)):
        gemv_calls.clear()
        got = triton_matmul.dequant_matmul(x.to(DEVICE), weight, scales16.to(DEVICE), zeros.to(DEVICE), group).cpu()
        torch.testing.assert_close(got, expected, atol=1e-4 * math.sqrt(k), rtol=1e-4)
        assert bool(gemv_calls) == by_words


@pytest.mark.parametrize("x_scale", [1.0, 2.0**60, 2.0**-40])
def test_one_row_4bit_codes_multiply_exactly_over_activations_large_and_tiny(x_scale: float) -> None:
    """The one-row kernel makes each 4-bit code a subnormal float and scales the input by up to
    2**53 (see the kernel): the products stay exact to float32 rounding for activations far above
    and below a model's; below 2**-30 each errs by at most 2**-54. One group a row (group 0, a
    scale per channel) takes the same products."""
    pytest.importorskip("triton")
    from pagellm.ops.triton.matmul import dequant_matmul

    n, k = 16, 128
    gen = torch.Generator().manual_seed(11)
    x, q = torch.randn(1, k, generator=gen) * x_scale, torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    q[:, :5] = 0  # zero codes beside large inputs: 0 times an overflowed input would be NaN
    scale = torch.rand(n, generator=gen) + 0.5
    expected = (x.double() @ (q.double() * scale.double()[:, None]).t()).float()
    atol = k * 2**-54 + 1e-6 * x_scale * math.sqrt(k)
    for rows in (1, 2):  # the one-row kernel, and the tiled one beside it
        got = dequant_matmul(x.expand(rows, k).to(DEVICE), pack_pairs(q).to(DEVICE), scale.to(DEVICE)).cpu()
        torch.testing.assert_close(got, expected.expand(rows, n), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("with_pdl", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("layout", ["int4", "int8", "dense"])
def test_one_row_kernel_loading_a_tile_ahead_sums_every_tile(prefetch: bool, layout: str, with_pdl: bool) -> None:
    """The autotuner's one-row tiles either load each tile as it comes or one tile ahead (4-bit
    words, 8-bit codes, dense weights); both cover every tile of a K of several (the last one
    partial) and rows past N's last tile. With PDL, on a Hopper GPU the product runs under
    programmatic dependent launch, x written by a kernel that lets it start early (the tile-ahead
    tiles read weights before waiting for it)."""
    pytest.importorskip("triton")
    from pagellm.ops.triton import matmul as triton_matmul
    from pagellm.ops.triton import norm as triton_norm
    from pagellm.ops.triton.utils import pdl

    n, k, group, block_k = 40, 224, 32, 64  # four tiles of K, the last half empty; three of N, one partial
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    if layout == "int4":
        q, scales, zeros = quantize_rtn(w, group)
        qweight, scales16 = pack_pairs(q), scales.half()
        w_ref = dequantize(qweight, scales16, zeros, group)
        weight = qweight.to(DEVICE).view(torch.int32)
        kinds = dict(GROUP=group, ZERO=-1, PACKED=True, PER_GROUP=True)
    elif layout == "int8":
        scales = w.abs().amax(1) / 127
        codes = torch.round(w / scales[:, None]).to(torch.int8)
        scales16, zeros, weight = scales.half(), torch.zeros(1), codes.to(DEVICE)
        w_ref = codes.float() * scales16.float()[:, None]
        kinds = dict(GROUP=0, ZERO=0, PACKED=False, PER_GROUP=False)
    else:
        w_ref, weight = w, w.to(DEVICE)
        scales16, zeros = torch.ones(1), torch.zeros(1)
        kinds = dict(GROUP=0, ZERO=0, PACKED=False, PER_GROUP=False, DENSE=True)
    out = torch.empty(1, n, device=DEVICE)
    scales_d, zeros_d = scales16.to(DEVICE), zeros.to(DEVICE)
    x_d = triton_norm.rms_norm(x.to(DEVICE), torch.ones(k, device=DEVICE), 1e-6)
    triton_matmul._gemv_kernel[(triton_matmul.triton.cdiv(n, 16),)](
        x_d, weight, scales_d, zeros_d, scales_d, out, n, k, weight.stride(0), scales_d.stride(0),
        zeros_d.stride(0), **kinds, OFFSET=False, BLOCK_N=16, BLOCK_K=block_k, PREFETCH=prefetch,
        **(pdl(x_d.device) if with_pdl else {}))
    torch.testing.assert_close(out.cpu(), x_d.cpu() @ w_ref.t(), atol=1e-4 * math.sqrt(k), rtol=1e-4)


def _run_run_ptx(ptx: str, operands: list[int]) -> float:
    """A model of the few PTX instructions `_run_ptx` uses: float16 arithmetic rounded once (each
    result computed exactly in float64 first), on registers of 32-bit words."""
    regs: dict[str, object] = {f"${i + 1}": v for i, v in enumerate(operands)}
    half2 = lambda r: np.frombuffer(np.uint32(regs[r]).tobytes(), np.float16).astype(np.float64)  # noqa: E731
    store = lambda r, v: regs.__setitem__(r, int(np.frombuffer(np.asarray(v, np.float16).tobytes(), np.uint32)[0]))  # noqa: E731
    for line in (part.strip().rstrip(";") for part in ptx.splitlines()):
        op, _, args = line.partition(" ")
        a = [t.strip() for t in args.split(",")]
        if op in ("{", "}") or op.startswith(".reg") or not op:
            continue
        if op == "mov.b32" and a[0].startswith("{"):  # {l, u}, h: the halves of h
            regs["l"], regs["u"] = half2(a[2])
        elif op == "mov.b32":
            regs[a[0]] = int(a[1], 0)
        elif op == "and.b32":
            regs[a[0]] = regs[a[1]] & int(a[2], 0)
        elif op == "shr.u32":
            regs[a[0]] = regs[a[1]] >> int(a[2])
        elif op == "fma.rn.f16x2":
            store(a[0], half2(a[1]) * half2(a[2]) + half2(a[3]))
        elif op == "add.rn.f16x2":
            store(a[0], half2(a[1]) + half2(a[2]))
        elif op == "cvt.f32.f16":
            regs[a[0]] = float(regs[a[1]])
        elif op == "add.f32":
            regs[a[0]] = float(np.float32(regs[a[1]]) + np.float32(regs[a[2]]))
        else:
            raise AssertionError(f"no model of {op}")
    return regs["$0"]


def test_one_row_float16_run_ptx_pairs_each_code_with_its_own_input() -> None:
    """The PTX of the float16 one-row tiles (`_run_ptx`), run through a model of its instructions:
    four words of eight codes (code j at bits 4j), each word's inputs given as the float16 pairs
    (y_0, y_4), (y_1, y_5), (y_2, y_6), (y_3, y_7), the odd ones divided by 16, sum to 2**-24 times
    the sum of code times input: every code met its own input (a swapped pair or word would not)."""
    triton = pytest.importorskip("triton")  # noqa: F841
    from pagellm.ops.triton.matmul import _run_ptx

    rng = np.random.default_rng(3)
    for _ in range(20):
        codes = rng.integers(0, 16, (4, 8))
        y = np.float16(rng.uniform(-2.0**14, 2.0**14, (4, 8)) * (rng.random((4, 8)) < 0.9))
        words = [int(sum(int(c) << (4 * j) for j, c in enumerate(row))) for row in codes]
        pairs = [[int(np.frombuffer(np.array([y[t, p] / (16 if p % 2 else 1), y[t, p + 4] / (16 if p % 2 else 1)],
                                             np.float16).tobytes(), np.uint32)[0]) for t in range(4)]
                 for p in range(4)]
        got = _run_run_ptx(_run_ptx(), words + [v for p in pairs for v in p])
        expected = float((codes * y.astype(np.float64)).sum()) * 2.0**-24
        scale = float((codes * np.abs(y.astype(np.float64))).sum()) * 2.0**-24
        assert abs(got - expected) <= 2.0**-9 * scale + 2.0**-23, (got, expected)


def _float16_tile_case(layout: str, x: torch.Tensor, n: int, gen: torch.Generator, device: torch.device):
    """A 4-bit layout for the float16 one-row tiles' tests, drawn from gen for inputs x [1, K]: the
    kernel's weight arguments on device (words, scales, zero points, offsets), its layout constants,
    and the float64 product with the dequantized weight and its bound sum |c s x|. Layouts: groups of
    128 or 32 with zero points, GPTQ's symmetric 8, offsets (GGUF), a scale per channel, one group a row."""
    from pagellm.ops.triton import matmul as triton_matmul

    k = x.shape[1]
    group = {"g128_zeros": 128, "g32_zeros": 32, "g128_symmetric": 128, "g32_offsets": 32, "channel": 0,
             "row": k}[layout]
    groups = k // group if group else 1
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, groups, generator=gen) * 0.1 + 0.01).half()
    zeros: torch.Tensor | int = (torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
                                 if layout.endswith("zeros") or layout == "row"
                                 else 8 if layout == "g128_symmetric" else 0)
    offsets = (torch.randn(n, groups, generator=gen) * 0.1).half() if layout == "g32_offsets" else None
    per_input = lambda t: t.double().repeat_interleave(k // groups, 1)  # noqa: E731
    z = per_input(zeros) if isinstance(zeros, torch.Tensor) else zeros
    w_ref = (q.double() - z) * per_input(scales) + (per_input(offsets) if offsets is not None else 0)
    ref = (x.double() @ w_ref.t())[0]
    # Products round in float16 as code times input, the zero point and offset taken off after in
    # float32: each errs by about 2**-11 of |c s x| (a dense bfloat16 weight: 2**-9 of |w x|).
    bound = (x.double().abs() @ (q.double() * per_input(scales)).t())[0]
    scales_d = (scales[:, 0] if not group else scales).contiguous().to(device)
    zero_arg, zero_const = triton_matmul._zero_args(zeros.to(device) if isinstance(zeros, torch.Tensor) else zeros,
                                                    scales_d)
    weights = (pack_pairs(q).to(device).view(torch.int32), scales_d, zero_arg,
               scales_d if offsets is None else offsets.to(device))
    constants = dict(GROUP=group, ZERO=zero_const, OFFSET=offsets is not None, PACKED=True,
                     PER_GROUP=triton_matmul._whole_group_tiles(group))
    return weights, constants, ref, bound


@pytest.mark.skipif(ON_GPU, reason="the GPU runs the PTX itself (test_one_row_4bit_float16_tiles_match_float64)")
@pytest.mark.parametrize("thread_runs", [False, True])
@pytest.mark.parametrize("layout", ["g128_zeros", "g128_symmetric", "g32_offsets", "channel", "row"])
def test_one_row_float16_tiles_hand_each_word_its_inputs(monkeypatch, layout: str, thread_runs: bool) -> None:
    """The float16 one-row tiles (HALF, with and without THREAD_RUNS) on Triton's interpreter, their
    inline PTX replaced by Triton models of it: against float64 on the dequantized weight, with an
    outlier input, zero points (GPTQ's symmetric 8 too), offsets, a scale per channel with K not a
    multiple of a run, one group a row, and K not a multiple of the tile (a word or run paired with
    another's inputs, a wrong scale, or a lost tail would not pass)."""
    triton = pytest.importorskip("triton")
    import ptx_models

    from pagellm.ops.triton import matmul as triton_matmul

    monkeypatch.setattr(triton_matmul, "_f16_pairs", ptx_models.f16_pairs)
    monkeypatch.setattr(triton_matmul, "_half_chunk_sums", ptx_models.half_chunk_sums)
    n, k = 40, 360 if layout == "channel" else 640
    gen = torch.Generator().manual_seed(len(layout) + thread_runs)
    x = torch.randn(1, k, generator=gen)
    x[0, 5] = 300.0
    x = x.bfloat16()
    weights, constants, ref, bound = _float16_tile_case(layout, x, n, gen, torch.device("cpu"))
    out = torch.full((n,), float("nan"))
    triton_matmul._gemv_kernel[(triton.cdiv(n, 16),)](
        x, *weights, out, n, k, weights[0].stride(0), weights[1].stride(0), weights[2].stride(0), **constants,
        BLOCK_N=16, BLOCK_K=256, HALF=True, THREAD_RUNS=thread_runs)
    assert bool(((out.double() - ref).abs() <= 2.0**-10 * bound).all())


@pytest.mark.skipif(not ON_GPU, reason="inline PTX: Triton's interpreter does not run it")
@pytest.mark.parametrize("inputs", ["normal", "tiny", "large", "outlier"])
@pytest.mark.parametrize("layout", ["g128_zeros", "g32_zeros", "g128_symmetric", "g32_offsets", "channel", "row"])
def test_one_row_4bit_float16_tiles_match_float64(layout: str, inputs: str) -> None:
    """Every HALF tile (codes as float16 subnormals, products in float16 pairs) against float64 on
    the dequantized weight: inputs from 2**-20 to 3e4 in bfloat16 (scaled per run of 32, never
    overflowing), and one input a thousand times the rest; groups of 128 and 32 with zero points,
    a constant zero point (GPTQ's symmetric 8), offsets (GGUF), a scale per channel with K not a
    multiple of a run, one group a row; N not a multiple of the tiles, nor K of most."""
    from pagellm.ops.triton import matmul as triton_matmul

    n, k = 4104, 4360 if layout == "channel" else 4352
    gen = torch.Generator().manual_seed(len(layout) + len(inputs))
    x = torch.randn(1, k, generator=gen) * {"normal": 1.0, "tiny": 2.0**-20, "large": 3e4, "outlier": 1.0}[inputs]
    if inputs == "outlier":
        x[0, 1000] = 1000.0
    x = x.bfloat16()
    (words, scales_d, zero_arg, offsets_d), constants, ref, bound = _float16_tile_case(layout, x, n, gen, DEVICE)
    half = [c for c in triton_matmul.one_row_candidates(constants, torch.bfloat16, DEVICE) if c.kwargs["HALF"]]
    assert len(half) >= 5 and not any(c.kwargs["HALF"] for c in triton_matmul.one_row_candidates(
        constants, torch.float32, DEVICE))
    x_d = x.to(DEVICE)
    for config in half:
        out = torch.full((n,), float("nan"), dtype=torch.float32, device=DEVICE)
        triton_matmul.launch_one_row(config, n, (x_d, words, scales_d, zero_arg, offsets_d, out, n, k, words.stride(0),
                                                 scales_d.stride(0), zero_arg.stride(0)), **constants)
        err = (out.double().cpu() - ref).abs()
        assert err.max() <= 4e-3 * ref.abs().max(), (config, err.max(), ref.abs().max())  # bf16 cuBLAS: 2.8-3.7e-3
        worst = int((err / bound).argmax())
        assert bool((err <= 2.0**-9 * bound + 1e-30).all()), (config, err[worst], bound[worst], ref[worst])


def test_one_row_tile_is_the_fastest_on_copies_timed_once_at_start_up_only(monkeypatch, tmp_path) -> None:
    """Each weight shape's one-row tile: within start-up's timing, every candidate that compiles is
    timed (on the weight's uncached copies), the fastest is kept and not timed again; a shape first
    met outside it, or inside a CUDA graph capture, takes the first candidate, untimed and not
    remembered; a shape no candidate compiles for is an error that names it."""
    import triton

    from pagellm.ops.triton import one_row_tiles

    configs = [triton.Config({"BLOCK_N": n}) for n in (2, 4, 8, 16)]
    shape, other, huge = (one_row_tiles.OneRowKey(torch.device("cpu"), n, 8, 8, torch.float32, torch.float32, None, ())
                          for n in (1, 2, 3))
    cost = {2: 9.0, 4: 5.0, 8: 7.0}  # BLOCK_N 16 does not fit the GPU
    timed: list[int] = []
    weight = torch.zeros(8, 8)

    def replay(product, weights):
        product(weights[-1])
        return cost[timed[-1]]

    def run(config, w):
        assert w is weight or w.shape == weight.shape
        timed.append(config.kwargs["BLOCK_N"])
        if config.kwargs["BLOCK_N"] == 16:
            raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")

    capturing = [False]
    monkeypatch.setattr(one_row_tiles, "_CHOSEN", {})
    monkeypatch.setattr(one_row_tiles, "_STORES", {})
    monkeypatch.setenv("PAGELLM_CACHE_ROOT", str(tmp_path))  # no choice stored yet
    monkeypatch.setattr(one_row_tiles, "uncached_copies", lambda w: [w, w.clone()])
    monkeypatch.setattr(one_row_tiles, "replay_us", replay)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert one_row_tiles.choose(shape, configs, run, weight) is configs[0] and not timed  # serving
    with one_row_tiles.timing_one_row_products():
        assert one_row_tiles.choose(shape, configs, run, weight).kwargs["BLOCK_N"] == 4
        assert sorted(set(timed)) == [2, 4, 8, 16]
        timed.clear()
        assert one_row_tiles.choose(shape, configs, run, weight).kwargs["BLOCK_N"] == 4 and not timed
        capturing[0] = True
        assert one_row_tiles.choose(other, configs, run, weight) is configs[0] and not timed
        capturing[0] = False
        assert other not in one_row_tiles._CHOSEN
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "a GPU")
        with pytest.raises(RuntimeError, match=r"no one-row tile compiles for OneRowKey\(.*n=3,.* on a GPU"):
            one_row_tiles.choose(huge, configs[3:], run, weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_one_row_kernel_matches_torch(dtype: torch.dtype) -> None:
    """A dense weight's one-row product (offered against cuBLAS at batch-1 decode) sums in float32
    over K tiles and N rows that do not divide evenly; a weight strided by columns is refused."""
    pytest.importorskip("triton")
    from pagellm.ops.triton.dense_one_row import dense_gemv

    n, k = 40, 200
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    got = dense_gemv(x.to(DEVICE), w.to(DEVICE)).cpu()
    assert got.dtype == dtype and got.shape == (1, n)
    expected = (x.double() @ w.double().t()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, atol=tol * math.sqrt(k), rtol=tol)
    with pytest.raises(ValueError, match="unit column stride"):
        dense_gemv(x.to(DEVICE), w.t().contiguous().t().to(DEVICE))  # [n, k], strided (1, n)


@pytest.mark.skipif(not ON_GPU, reason="cuBLAS against the one-row kernel: timed on a GPU")
def test_dense_one_row_steps_take_the_product_timed_faster_at_start_up(monkeypatch) -> None:
    """At one row the unquantized method takes the one-row kernel where start-up timed it faster
    than cuBLAS; a shape first met later keeps cuBLAS (nothing is timed while serving). Either
    way the product agrees with cuBLAS's."""
    from pagellm.layers.linear import ColumnParallelLinear
    from pagellm.ops.triton import dense_one_row, one_row_tiles

    monkeypatch.setattr(dense_one_row, "_FASTER", {})
    used: list[int] = []
    real = dense_one_row.dense_gemv
    monkeypatch.setattr(dense_one_row, "dense_gemv", lambda *a: used.append(1) or real(*a))
    for n, k in ((4096, 4096), (8192, 1024)):
        layer = ColumnParallelLinear(k, n).to(DEVICE, torch.bfloat16)
        torch.nn.init.normal_(layer.weight, std=k**-0.5)
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        key = (x.device, (n, k), k, torch.bfloat16, torch.bfloat16)
        used.clear()
        layer(x)  # not at start-up: cuBLAS, untimed
        assert key not in dense_one_row._FASTER and not used
        with one_row_tiles.timing_one_row_products():
            layer(x)
        used.clear()
        got = layer(x)
        assert bool(used) == dense_one_row._FASTER[key]
        torch.testing.assert_close(got.float(), torch.nn.functional.linear(x, layer.weight).float(), atol=2e-2,
                                   rtol=2e-2)


@pytest.mark.parametrize("group", [32, 96, 128, 0])
def test_dequantize_kernel_gives_the_layouts_weights(group: int) -> None:
    """Large steps multiply with cuBLAS on the weight this kernel writes: 4-bit codes with zero
    points per group (or per channel), 8-bit codes with a scale per channel; groups that tiles
    hold whole (32), that hold a tile (128, the channel), or neither (96)."""
    pytest.importorskip("triton")
    from pagellm.ops.triton.matmul import dequantize_weight

    n, k = (4096, 4608 + 32) if ON_GPU else (40, 384 + 32)  # K not a multiple of the tiles' 128
    if k % (group or k):
        k -= 32  # groups of 96 need whole groups
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(group))
    q, scales, zeros = quantize_rtn(w, group or k)
    qweight, scales16 = pack_pairs(q), scales.half()
    got = dequantize_weight(qweight.to(DEVICE), scales16.to(DEVICE), zeros.to(DEVICE), group or k, dtype=torch.float32)
    assert torch.equal(got.cpu(), dequantize(qweight, scales16, zeros, group or k))
    if group == 0:
        for dtype in (torch.int8, torch.float8_e4m3fn):
            q8, scale = quantize_per_row(w, dtype)
            got = dequantize_weight(q8.to(DEVICE), scale.to(DEVICE), dtype=torch.float32)
            assert torch.equal(got.cpu(), q8.float() * scale[:, None])


def test_smoothing_scales_fold_into_norms_and_columns_without_changing_the_model(tmp_path) -> None:
    """SmoothQuant's fold divides each norm channel by s and multiplies the next layer's input
    column by s: the dense model computes the same function."""
    from pagellm.quantization import smoothing

    hf = _tiny_hf()
    hf.save_pretrained(tmp_path)
    model, _ = _load(str(tmp_path))
    ids = list(range(3, 43))
    before = log_probs(model, ids)
    pairs = [pair for layer in model.decoder_layers() for pair in layer.smoothable()]
    inputs = smoothing.layer_inputs(model, [linear for _, linear in pairs], Calibration(ids, prompt_hidden_states))
    assert set(inputs) == {linear for _, linear in pairs} and all(x.shape == (40, 64) for x in inputs.values())
    maxima = {linear: x.abs().amax(dim=0) for linear, x in inputs.items()}
    norm, qkv = pairs[0]
    weights = norm.weight.clone(), qkv.weight.clone()
    for norm_, linear in pairs:
        smoothing.fold(norm_, linear, smoothing.scale(maxima[linear] * torch.linspace(0.1, 50, 64), linear.weight,
                                                      smoothing.ALPHA))
    assert not torch.allclose(norm.weight, weights[0]) and not torch.allclose(qkv.weight, weights[1])
    torch.testing.assert_close(log_probs(model, ids), before, atol=1e-4, rtol=0)


@pytest.mark.slow  # ~15-30 s on 2 CPU cores: too dear for the quick tier
def test_clipping_keeps_per_group_the_range_whose_rounding_errs_least(tmp_path, monkeypatch) -> None:
    """AWQ's clipping search, on layers of several groups searched a few rows at a time: each group
    of each row of the clippable layers becomes one of the grid's clamps of it, the one whose
    rounded product with the calibration inputs errs least (judged group by group here); some are
    clipped, and the q/k/v projection is left alone."""
    from pagellm.quantization import smoothing
    from pagellm.quantization.int4 import _rtn_group, _rtn_values

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dict(TINY, hidden_size=256,
                                                                       intermediate_size=512))).eval()
    hf.save_pretrained(tmp_path)
    model, _ = _load(str(tmp_path))
    monkeypatch.setattr(smoothing, "CLIP_ELEMENTS", 7 * 256)  # 7 rows at a time (3 of down_proj's)
    ids = list(range(3, 83))
    layers = [linear for layer in model.decoder_layers() for linear in layer.clippable()]
    qkv = [layer.self_attn.qkv_proj.weight.clone() for layer in model.decoder_layers()]
    calibration = Calibration(ids, prompt_hidden_states)
    inputs = smoothing.layer_inputs(model, layers, calibration)
    before = {linear: linear.weight.clone() for linear in layers}
    assert smoothing.clip(model, calibration, _rtn_values, _rtn_group) == len(layers) == 6
    clipped = 0
    for linear in layers:
        w0, n, k = before[linear], *before[linear].shape
        g = _rtn_group(k)
        assert k // g >= 2
        x = inputs[linear][::smoothing.SEARCH_STRIDE]
        low = w0.reshape(n, -1, g).amin(-1, keepdim=True).clamp(max=0)
        high = w0.reshape(n, -1, g).amax(-1, keepdim=True).clamp(min=0)
        candidates = [torch.minimum(torch.maximum(w0.reshape(n, -1, g), low * r), high * r).reshape(n, k)
                      for r in smoothing.CLIP_GRID]

        def errors(w: torch.Tensor) -> torch.Tensor:  # [n, groups]
            delta = w0 - _rtn_values(w)
            return torch.stack([(x[:, j:j + g] @ delta[:, j:j + g].t()).square().mean(0) for j in range(0, k, g)], 1)

        least = torch.stack([errors(c) for c in candidates]).amin(0)
        assert bool((errors(linear.weight) <= least * (1 + 1e-4) + 1e-12).all())
        got = linear.weight.reshape(n, -1, g)
        assert all(bool(torch.stack([(got[i, j] == c.reshape(n, -1, g)[i, j]).all() for c in candidates]).any())
                   for i in range(n) for j in range(k // g))
        clipped += int((got != w0.reshape(n, -1, g)).any(-1).sum())
    assert clipped > 0
    assert all(torch.equal(layer.self_attn.qkv_proj.weight, w) for layer, w in zip(model.decoder_layers(), qkv))


@pytest.mark.slow
def test_rtn_clips_at_load_and_comes_closer_to_the_dense_model(smollm2_path, monkeypatch) -> None:
    """rtn's load runs the clipping search after the activation-aware scales: SmolLM2's next-token
    distributions move less from the dense model's than without it (on text not calibrated on)."""
    from importlib import resources

    from pagellm.quantization import smoothing
    from pagellm.tokenizer.tokenizer import load_tokenizer

    cfg = EngineArgs(model=smollm2_path, device="cpu", dtype="float32").create_engine_config()
    text = resources.files("pagellm.eval").joinpath("sample.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(cfg.model.source).encode(text)[:200]
    dense = log_probs(_load(smollm2_path)[0], ids)

    def kl() -> float:
        lp = log_probs(_load(smollm2_path, quantization="rtn")[0], ids)
        return (dense.exp() * (dense - lp)).sum(dim=-1).mean().item()

    clipped = kl()
    monkeypatch.setattr(smoothing, "clip", lambda *args: 0)
    assert clipped < 0.9 * kl()


@pytest.mark.slow
@pytest.mark.parametrize(("method", "config", "ratio"), [("int8", "W8A8Config", 0.7), ("rtn", "Int4Config", 0.85)])
def test_calibrated_scales_bring_the_quantized_model_closer_to_the_dense_one(smollm2_path, monkeypatch, method,
                                                                             config, ratio) -> None:
    """Scales calibrated at load on the package's text, measured on text they were not calibrated
    on: SmoothQuant halves int8 W8A8's KL divergence from the dense SmolLM2, activation-aware
    scales cut rtn's (4-bit) by more than the margin here."""
    from importlib import resources

    from pagellm.quantization import int4, w8a8
    from pagellm.tokenizer.tokenizer import load_tokenizer

    cfg = EngineArgs(model=smollm2_path, device="cpu", dtype="float32").create_engine_config()
    text = resources.files("pagellm.eval").joinpath("sample.txt").read_text(encoding="utf-8")
    ids = load_tokenizer(cfg.model.source).encode(text)[:200]
    assert len(ids) > SMALL_BATCH_ROWS  # int8: 8-bit activations
    dense = log_probs(_load(smollm2_path)[0], ids)

    def kl() -> float:
        lp = log_probs(_load(smollm2_path, quantization=method)[0], ids)
        return (dense.exp() * (dense - lp)).sum(dim=-1).mean().item()

    calibrated = kl()
    module = w8a8 if method == "int8" else int4
    monkeypatch.setattr(getattr(module, config), "prepare_weights", lambda self, model, source: None)
    plain = kl()
    assert calibrated < ratio * plain, (calibrated, plain)


@pytest.mark.slow
def test_calibration_stays_within_the_models_positions(smollm2_path) -> None:
    """A model with fewer positions than the calibration text's tokens is calibrated on as many as
    it has (beyond them the rotary table has no row: NaN weights, or an IndexError)."""
    config = EngineArgs(model=smollm2_path, device="cpu", dtype="float32", quantization="int8",
                        attention_backend="torch").create_engine_config()
    config.model.source.arch.max_position_embeddings = 48
    model = build_model(config.model.source, config.model.quantization, config.model.dtype, CPU, "torch", 0)
    dense = build_model(config.model.source, None, config.model.dtype, CPU, "torch", 0)
    norm = model.model.layers[0].input_layernorm.weight
    assert bool(norm.isfinite().all()) and not torch.equal(norm, dense.model.layers[0].input_layernorm.weight)
    assert bool(log_probs(model, list(range(100, 140))).isfinite().all())


@pytest.mark.skipif(not ON_GPU, reason="the interpreter rounds to float8 wrongly where a carry changes the exponent")
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantize_rows_kernel_matches_torch(dtype: torch.dtype) -> None:
    from pagellm.ops.triton.matmul import quantize_rows

    x = torch.randn(300, 14336, device=DEVICE) * torch.logspace(-3, 3, 300, device=DEVICE)[:, None]
    x[7] = 0  # an all-zero row keeps a positive scale
    for x_dtype in (torch.float32, torch.bfloat16):
        q, scale = quantize_rows(x.to(x_dtype), dtype)
        q_ref, scale_ref = quantize_per_row(x.to(x_dtype), dtype)
        assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


# --- 8-bit -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,fmt", [("FP8_DYNAMIC", "float-quantized"), ("W8A8", "int-quantized"),
                                        ("int8 weight-only", "int-quantized")])
def test_compressed_tensors_checkpoint_written_by_the_library(tmp_path, preset: str, fmt: str) -> None:
    """llm-compressor's format, written by compressed-tensors itself: the loaded weights are the
    library's own decompression, and the logits of a short prompt (16-bit activations) are
    Hugging Face's on those weights."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    hf = _tiny_hf()
    scheme = preset_name_to_scheme(preset, ["Linear"]) if preset != "int8 weight-only" else QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True))
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    qmax = 448.0 if scheme.weights.type == "float" else 127.0
    for _, m in _projections(hf):
        m.weight_scale.data = (m.weight.abs().amax(dim=1, keepdim=True) / qmax).to(m.weight_scale.dtype)
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format=fmt)
    compressor.compress_model(hf)
    hf.save_pretrained(tmp_path)
    compressor.update_config(str(tmp_path))
    compressor.decompress_model(hf)  # the library's dequantized weights: the reference
    assert ct is not None
    dense_hf = _tiny_hf()  # those weights without the library's activation fake-quantization hooks
    for (_, m), (_, dense) in zip(_projections(hf), _projections(dense_hf), strict=True):
        dense.weight.data = m.weight.data.float()

    model, method = _load(str(tmp_path))
    assert method == "compressed-tensors"
    layer = model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == (torch.float8_e4m3fn if scheme.weights.type == "float" else torch.int8)
    attn = hf.model.layers[0].self_attn
    dense = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    torch.testing.assert_close(layer.weight.float() * layer.weight_scale[:, None], dense.float(), atol=0, rtol=0)
    _assert_matches_hf(model, dense_hf, SMALL_BATCH_ROWS)


def test_float8_weights_take_each_rows_nearest_scale() -> None:
    """fp8 weights quantized at load: each row's scale is max / 448 or one a fraction above it,
    whichever rounds the row nearest; never below (no weight clipped). Over many rows that errs
    clearly less than max / 448 alone; int8 keeps max / 127."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(256, 512, generator=gen) * torch.logspace(-3, 1, 256)[:, None]
    q, scale = quantize_weight_rows(w, torch.float8_e4m3fn)
    q0, scale0 = quantize_per_row(w, torch.float8_e4m3fn)
    err = ((q.float() * scale[:, None] - w) ** 2).sum(1)
    err0 = ((q0.float() * scale0[:, None] - w) ** 2).sum(1)
    assert bool((err <= err0).all()) and err.sum() < 0.95 * err0.sum()
    steps = (scale / scale0 - 1) * FP8_SCALE_STEPS  # which of the candidate scales each row took
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    assert bool((steps >= 0).all() and (steps < FP8_SCALE_STEPS).all())
    assert len(steps.round().unique()) > 1
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= 448
    q8, scale8 = quantize_weight_rows(w, torch.int8)
    q8_ref, scale8_ref = quantize_per_row(w, torch.int8)
    assert torch.equal(q8, q8_ref) and torch.equal(scale8, scale8_ref)


@pytest.mark.parametrize("method,dtype", [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_online_8bit_quantizes_per_channel_and_activations_per_token(tmp_path, method: str, dtype) -> None:
    hf = _tiny_hf()
    hf.save_pretrained(tmp_path)
    model, resolved = _load(str(tmp_path), quantization=method)
    assert resolved == method
    up = model.model.layers[1].mlp.gate_up_proj
    dense = torch.cat([hf.model.layers[1].mlp.gate_proj.weight, hf.model.layers[1].mlp.up_proj.weight])
    q, scale = quantize_weight_rows(dense, dtype)
    assert up.weight.dtype == dtype and torch.equal(up.weight, q) and torch.equal(up.weight_scale, scale)
    # Few rows: 16-bit activations against the 8-bit weights.
    x = torch.randn(SMALL_BATCH_ROWS, 64)
    torch.testing.assert_close(up(x), x @ (q.float() * scale[:, None]).t(), atol=1e-5, rtol=1e-5)
    # More rows: each activation row quantized to the same type with its own scale.
    x = torch.randn(SMALL_BATCH_ROWS + 1, 64) * torch.logspace(-2, 2, SMALL_BATCH_ROWS + 1)[:, None]
    amax = x.abs().amax(dim=1, keepdim=True)
    qmax = 448.0 if dtype == torch.float8_e4m3fn else 127.0
    xq = (x / (amax / qmax)).to(dtype) if dtype != torch.int8 else (x / (amax / qmax)).round().to(dtype)
    expected = (xq.float() @ q.float().t()) * (amax / qmax) * scale
    torch.testing.assert_close(up(x), expected, atol=1e-4, rtol=1e-5)
    assert not torch.allclose(up(x), x @ (q.float() * scale[:, None]).t(), atol=1e-5, rtol=1e-5)
    for _, m in _projections(hf):  # Hugging Face on the dequantized weights, for a short prompt
        q, scale = quantize_weight_rows(m.weight.data, dtype)
        m.weight.data = q.float() * scale[:, None]
    _assert_matches_hf(model, hf, SMALL_BATCH_ROWS)


def test_fp8_checkpoint_per_tensor_scales_of_fused_layers(tmp_path) -> None:
    """An `fp8` checkpoint (AutoFP8 / vLLM's layout) with one scale per tensor: q, k and v keep
    their own scales inside the fused layer; static activation scales are read and not used."""
    hf = _tiny_hf()
    tensors = {}
    for name, m in _projections(hf):
        scale = m.weight.abs().amax() / 448.0
        q = (m.weight / scale).to(torch.float8_e4m3fn)
        tensors.update({f"{name}.weight": q, f"{name}.weight_scale": scale.reshape(()),
                        f"{name}.input_scale": torch.tensor(0.5)})
        m.weight.data = q.float() * scale
    _write_checkpoint(tmp_path, hf, tensors, {"quant_method": "fp8", "activation_scheme": "static"})
    model, method = _load(str(tmp_path))
    assert method == "fp8" and not hasattr(model.model.layers[0].self_attn.qkv_proj, "input_scale")
    scales = model.model.layers[0].self_attn.qkv_proj.weight_scale
    assert len(set(scales.tolist())) == 3  # q, k, v
    _assert_matches_hf(model, hf, 12)


# --- int4 --------------------------------------------------------------------------------------------


def _gptq_pack(q: np.ndarray, zeros: np.ndarray, minus_one: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's documented layout: q [K, N] -> qweight int32 [K / 8, N], value k in bits 4 (k % 8) of
    row k // 8; zeros [G, N] -> qzeros int32 [G, N / 8] packed the same way along N (minus one in
    the "gptq" format)."""
    shifts = (np.arange(8) * 4).astype(np.uint64)
    qweight = (q.reshape(-1, 8, q.shape[1]).astype(np.uint64) << shifts[None, :, None]).sum(axis=1)
    stored = (zeros - 1) & 0xF if minus_one else zeros
    qzeros = (stored.reshape(stored.shape[0], -1, 8).astype(np.uint64) << shifts).sum(axis=2)
    as_int32 = lambda a: torch.from_numpy(a.astype(np.uint32).view(np.int32))  # noqa: E731
    return as_int32(qweight), as_int32(qzeros)


@pytest.mark.parametrize("group,act_order,fmt,side_file", [
    (32, False, "gptq", False), (64, True, "gptq", False), (32, True, "gptq_v2", False), (-1, False, "gptq_v2", False),
    (32, False, "gptq", True)])  # AutoGPTQ's quantize_config.json beside a config.json without quantization_config
def test_gptq_checkpoint(tmp_path, group: int, act_order: bool, fmt: str, side_file: bool) -> None:
    hf = _tiny_hf()
    rng = np.random.default_rng(abs(group) + act_order)
    tensors = {}
    for name, m in _projections(hf):
        n, k = m.weight.shape
        g = k if group == -1 else group
        q = rng.integers(0, 16, (k, n))
        zeros = rng.integers(1, 16, (k // g, n))
        scales = torch.from_numpy(rng.uniform(0.002, 0.02, (k // g, n))).half()
        # act-order: the groups follow an order of the input features, one per input (GPTQ orders by
        # the inputs' Hessian: q, k and v share theirs, as gate and up do)
        order = np.random.default_rng(k + ("mlp" in name) + ("down" in name)).permutation(k)
        g_idx = (np.argsort(order) // g) if act_order else np.arange(k) // g
        qweight, qzeros = _gptq_pack(q, zeros, minus_one=fmt == "gptq")
        tensors.update({f"{name}.qweight": qweight, f"{name}.qzeros": qzeros, f"{name}.scales": scales,
                        f"{name}.g_idx": torch.from_numpy(g_idx.astype(np.int32))})
        dense = (torch.from_numpy(q - zeros[g_idx]).float() * scales.float()[torch.from_numpy(g_idx)]).t()
        m.weight.data = dense  # what the checkpoint means: Hugging Face runs it dense
    settings = {"bits": 4, "group_size": group, "desc_act": act_order, "sym": False, "checkpoint_format": fmt}
    _write_checkpoint(tmp_path, hf, tensors, {"quant_method": "gptq", **settings})
    if side_file:  # AutoGPTQ before transformers' quantization_config: no quant_method either
        config = json.loads((tmp_path / "config.json").read_text())
        del config["quantization_config"]
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "quantize_config.json").write_text(json.dumps(settings))
    model, method = _load(str(tmp_path))
    assert method == "gptq"
    down = model.model.layers[0].mlp.down_proj
    assert (down.perm is not None) == act_order
    weight = dequantize(down.qweight, down.scales, down.zeros, down.quant_method.group)
    if act_order:
        weight = torch.empty_like(weight).index_copy_(1, down.perm, weight)
    torch.testing.assert_close(weight, hf.model.layers[0].mlp.down_proj.weight, atol=0, rtol=0)
    _assert_matches_hf(model, hf, 20)


def test_awq_checkpoint_written_by_autoawq(tmp_path) -> None:
    """AutoAWQ's GEMM packing (its own `WQLinear_GEMM.from_linear`), dequantized as AutoAWQ does."""
    pytest.importorskip("awq")
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    hf, group = _tiny_hf(), 32
    tensors = {}
    for name, m in _projections(hf):
        n, k = m.weight.shape
        w = m.weight.data.reshape(n, k // group, group)
        low, high = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((high - low) / 15).half().float()
        zeros = (-low / scales).round().clamp(0, 15)
        q = (w / scales[..., None] + zeros[..., None]).round().clamp(0, 15)
        m.weight.data = ((q - zeros[..., None]) * scales[..., None]).reshape(n, k)  # what the checkpoint means
        awq = WQLinear_GEMM.from_linear(m, 4, group, scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
        tensors.update({f"{name}.qweight": awq.qweight, f"{name}.qzeros": awq.qzeros, f"{name}.scales": awq.scales})
        # AutoAWQ's own unpacking (in float16) agrees
        torch.testing.assert_close(dequantize_gemm(awq.qweight, awq.qzeros, awq.scales, 4, group).float().t(),
                                   m.weight.data, rtol=2**-10, atol=0)
    _write_checkpoint(tmp_path, hf, tensors, {"quant_method": "awq", "bits": 4, "group_size": group,
                                              "zero_point": True, "version": "gemm"})
    model, method = _load(str(tmp_path))
    assert method == "awq"
    gate_up = model.model.layers[1].mlp.gate_up_proj
    mlp = hf.model.layers[1].mlp
    torch.testing.assert_close(dequantize(gate_up.qweight, gate_up.scales, gate_up.zeros, group),
                               torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), atol=0, rtol=0)
    _assert_matches_hf(model, hf, 20)


def test_rtn_quantizes_groups_at_load(tmp_path) -> None:
    hf = _tiny_hf()
    hf.save_pretrained(tmp_path)
    model, method = _load(str(tmp_path), quantization="rtn")
    o_proj = model.model.layers[0].self_attn.o_proj
    dense = hf.model.layers[0].self_attn.o_proj.weight
    assert method == "rtn" and o_proj.qweight.shape == (64, 32) and o_proj.quant_method.group == 64
    error = dequantize(o_proj.qweight, o_proj.scales, o_proj.zeros, 64) - dense
    assert error.abs().max() <= o_proj.scales.float().max() * 0.51  # rounding to nearest only
    for _, m in _projections(hf):  # Hugging Face on the dequantized weights
        group = 64 if m.weight.shape[1] % 128 else 128
        q, scales, zeros = quantize_rtn(m.weight.data, group)
        m.weight.data = dequantize(pack_pairs(q), scales.half(), zeros, group)
    _assert_matches_hf(model, hf, 20)


# --- errors and tensor parallelism ------------------------------------------------------------------


def test_quantization_errors_name_the_flag(tmp_path) -> None:
    hf = _tiny_hf()
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--quantization\) must be one of fp8, int8, compressed-tensors"):
        EngineArgs(quantization="fp4").validate()
    with pytest.raises(ValueError, match=r"--quantization\) 'gptq' loads a checkpoint quantized with gptq.*use rtn"):
        resolve_quantization("gptq", "safetensors", str(tmp_path), CPU, hf.config.to_dict())
    awq_config = {**hf.config.to_dict(), "quantization_config": {"quant_method": "awq"}}
    with pytest.raises(ValueError, match=r"--quantization\) is 'fp8', but .* holds awq weights"):
        resolve_quantization("fp8", "safetensors", str(tmp_path), CPU, awq_config)
    assert resolve_quantization(None, "safetensors", str(tmp_path), CPU, awq_config) == "awq"
    assert resolve_quantization(None, "safetensors", str(tmp_path), CPU,
                                {"quantization_config": {"quant_method": "GPTQ"}}) == "gptq"  # as vLLM reads it
    # A draft model's setting is named as the key of --speculative-config it is, not as --quantization.
    draft = tmp_path / "draft"
    draft.mkdir()
    _write_checkpoint(draft, hf, {}, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    speculative = json.dumps({"model": str(draft), "num_speculative_tokens": 2, "quantization": "awq"})
    with pytest.raises(ValueError, match=r"^speculative_config \(--speculative-config\) model .*: \"quantization\" is "
                                         r"'awq', but .* holds gptq weights.*make it 'gptq' or leave it out"):
        EngineArgs(model=str(tmp_path), device="cpu", speculative_config=speculative).create_engine_config()
    with pytest.raises(ValueError, match="random weights are dense"):
        resolve_quantization(None, "dummy", str(tmp_path), CPU, awq_config)
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        resolve_quantization(None, "safetensors", str(tmp_path), CPU,
                             {"quantization_config": {"quant_method": "bitsandbytes"}})
    int4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}
    for bad, message in [({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit"),
                         ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size"),
                         ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
                         ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"g": {"weights": {**int4, "num_bits": 2}}}}, "2-bit"),
                         ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"g": {"weights": {**int4, "actorder": "group"}}}}, "weight_g_idx"),
                         ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                           "config_groups": {"g": {"weights": int4, "input_activations": {"num_bits": 8}}}},
                          "quantized activations"),
                         ({"quant_method": "compressed-tensors", "format": "dense", "config_groups": {"g": {
                             "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "format 'dense'"),
                         ({"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8},
                           "config_groups": {"g": {"weights": int4}}}, "kv_cache_scheme"),
                         # dense weights under an fp8 config: codes are never read as values or back
                         ({"quant_method": "fp8"}, "type torch.float32 does not fit a parameter of type "
                                                   "torch.float8_e4m3fn"),
                         # dense weights under an awq config: not a different architecture
                         ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True},
                          r"quantization_config \(or --quantization\) describe how its layers are stored\? "
                          r"'model\.layers\.0\.\S+' here holds qweight, qzeros, scales")]:
        _write_checkpoint(tmp_path, hf, {}, bad)
        with pytest.raises(ValueError, match=message):
            _load(str(tmp_path))


def test_packed_parameters_shard_across_ranks() -> None:
    """GPTQ's int32 words hold 8 values along K (qweight) or N (qzeros): rank 1 of 2 takes its half
    of both, and of the per-group scales, for column- and row-parallel layers."""
    from pagellm.distributed import init_tensor_parallel
    from pagellm.layers import MergedColumnParallelLinear, RowParallelLinear
    from pagellm.quantization.int4 import Int4Format, Int4LinearMethod

    init_tensor_parallel(rank=1, world_size=2)
    try:
        gate_up = MergedColumnParallelLinear(64, [32, 32])
        gate_up.set_quant_method(Int4LinearMethod(Int4Format("gptq", 32)))
        row = RowParallelLinear(128, 16)
        row.set_quant_method(Int4LinearMethod(Int4Format("gptq", 32)))
    finally:
        init_tensor_parallel(rank=0, world_size=1)
    qweight = torch.arange(8 * 32, dtype=torch.int32).view(8, 32)  # K = 64, N = 32
    qzeros = torch.arange(2 * 4, dtype=torch.int32).view(2, 4)
    init_tensor_parallel(rank=1, world_size=2)
    try:
        gate_up.qweight.weight_loader(gate_up.qweight, qweight, 0)
        gate_up.qweight.weight_loader(gate_up.qweight, qweight + 1000, 1)
        gate_up.qzeros.weight_loader(gate_up.qzeros, qzeros, 1)
        row_qweight = torch.arange(16 * 16, dtype=torch.int32).view(16, 16)  # K = 128 (64 a rank), N = 16
        row_scales = torch.arange(4 * 16, dtype=torch.float32).view(4, 16)  # 4 groups of 32 (2 a rank)
        row.qweight.weight_loader(row.qweight, row_qweight)
        row.scales.weight_loader(row.scales, row_scales)
    finally:
        init_tensor_parallel(rank=0, world_size=1)
    assert torch.equal(gate_up.qweight, torch.cat([qweight[:, 16:], qweight[:, 16:] + 1000], dim=1))
    assert torch.equal(gate_up.qzeros[:, 2:], qzeros[:, 2:])  # gate's N/8 words first, then up's
    assert torch.equal(row.qweight, row_qweight[8:]) and torch.equal(row.scales, row_scales[2:])


def test_gptq_row_parallel_rank_loads_and_dequantizes_its_slice() -> None:
    """Rank 1 of 2 of a row-parallel GPTQ layer: its g_idx slice numbers groups from its first one
    (not act order), and a rank holding a single group is not a per-channel layer."""
    from pagellm.distributed import init_tensor_parallel
    from pagellm.layers import RowParallelLinear
    from pagellm.layers.linear_method import process_weights_after_loading
    from pagellm.quantization.int4 import Int4Format, Int4LinearMethod

    rng = np.random.default_rng(0)
    for k, group in ((128, 32), (64, 32)):  # two groups a rank; one group a rank
        n = 16
        q, zeros = rng.integers(0, 16, (k, n)), rng.integers(1, 16, (k // group, n))
        scales = torch.from_numpy(rng.uniform(0.01, 0.02, (k // group, n))).half()
        qweight, qzeros = _gptq_pack(q, zeros, minus_one=False)
        g_idx = torch.arange(k, dtype=torch.int32) // group
        init_tensor_parallel(rank=1, world_size=2)
        try:
            row = RowParallelLinear(k, n)
            row.set_quant_method(Int4LinearMethod(Int4Format("gptq", group)))
            for name, tensor in (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
                getattr(row, name).weight_loader(getattr(row, name), tensor)
            process_weights_after_loading([row])
        finally:
            init_tensor_parallel(rank=0, world_size=1)
        dense = (torch.from_numpy(q - zeros[g_idx.numpy()]).float() * scales.float()[g_idx.long()]).t()
        assert row.perm is None
        torch.testing.assert_close(dequantize(row.qweight, row.scales, row.zeros, group), dense[:, k // 2:],
                                   atol=0, rtol=0)


# --- FP8 KV cache ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_fp8_kv_cache_holds_more_blocks_and_keeps_the_greedy_start(smollm2_path) -> None:
    from pagellm import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=1)
    runs = {}
    for kv in ("auto", "fp8"):
        llm = LLM(smollm2_path, device="cpu", dtype="float32", quantization="none", kv_cache_memory_bytes=32 << 20,
                  max_model_len=256, kv_cache_dtype=kv)
        runs[kv] = (llm.llm_engine.engine_core.num_blocks, llm.llm_engine.config.model.attention_backend,
                    llm.generate(prompts, params, use_tqdm=False))
        del llm
    # float32 entries -> 1 byte: four times the blocks in the same bytes (each count rounded down)
    assert 4 * runs["auto"][0] <= runs["fp8"][0] < 4 * (runs["auto"][0] + 1) and runs["fp8"][1] == "torch"
    for full, fp8 in zip(runs["auto"][2], runs["fp8"][2]):
        first_full, first_fp8 = full.outputs[0], fp8.outputs[0]
        assert first_full.token_ids[0] == first_fp8.token_ids[0]
        token = first_full.token_ids[0]
        assert abs(first_full.logprobs[0][token].logprob - first_fp8.logprobs[0][token].logprob) < 0.1


def test_checkpoint_kv_scales_reach_the_layers(tmp_path) -> None:
    """Per-tensor KV scales in a checkpoint (llm-compressor's k_scale/v_scale, AutoFP8's
    k_proj/v_proj.output_scale) land on their layers' attention; a float8 cache applies them (what
    they do is checked per layer in test_attention_triton), a cache in the model's dtype ignores them."""
    from pagellm.eval.quality import bind_window_cache

    hf = _tiny_hf()
    scales = {"model.layers.0.self_attn.k_scale": 0.05, "model.layers.0.self_attn.v_scale": 0.02,
              "model.layers.1.self_attn.k_proj.output_scale": 0.04,
              "model.layers.1.self_attn.v_proj.output_scale": 0.03}
    hf.save_pretrained(tmp_path / "plain")
    (tmp_path / "scaled").mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state | {k: torch.tensor([v]) for k, v in scales.items()}, str(tmp_path / "scaled" / "model.safetensors"))
    (tmp_path / "scaled" / "config.json").write_text(json.dumps(hf.config.to_dict()))
    plain, _ = _load(str(tmp_path / "plain"))
    scaled, _ = _load(str(tmp_path / "scaled"))
    attn = [layer.self_attn.attn for layer in scaled.model.layers]
    assert [a.k_scale for a in attn] + [a.v_scale for a in attn] == pytest.approx([0.05, 0.04, 0.02, 0.03], rel=1e-6)
    ids = torch.randint(TINY["vocab_size"], (37,), generator=torch.Generator().manual_seed(2)).tolist()
    results = {}
    for dtype in (torch.float32, torch.float8_e4m3fn):
        for name, model in (("plain", plain), ("scaled", scaled)):
            bind_window_cache(model, 64, dtype, CPU)
            results[name, dtype] = log_probs(model, ids)
    assert torch.equal(results["scaled", torch.float32], results["plain", torch.float32])
    fp8 = results["scaled", torch.float8_e4m3fn]
    assert not torch.allclose(fp8, results["plain", torch.float8_e4m3fn], atol=1e-6, rtol=0)
    # As far from the float32 cache as the unscaled float8 cache is (a misapplied scale is far off).
    error = {name: (results[name, torch.float8_e4m3fn] - results["plain", torch.float32]).abs().max().item()
             for name in ("plain", "scaled")}
    assert error["scaled"] < 2 * error["plain"], error
    with pytest.raises(ValueError, match="per-tensor"):
        attn[0].load_kv_scale("k_scale", torch.ones(4))
    # llm-compressor's scheme for such scales is accepted; a dynamic or integer one is not.
    from pagellm.quantization import compressed_tensors_weights

    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    qc = {"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float"}}}, "kv_cache_scheme": scheme}
    assert compressed_tensors_weights(qc)["type"] == "float"
    for bad in ({"dynamic": True}, {"type": "int"}):
        with pytest.raises(ValueError, match="kv_cache_scheme"):
            compressed_tensors_weights(qc | {"kv_cache_scheme": scheme | bad})


@pytest.mark.slow
def test_kv_cache_dtype_errors_name_the_flag(smollm2_path) -> None:
    with pytest.raises(ValueError, match=r"--kv-cache-dtype\) must be one of auto, fp8, fp8_e4m3"):
        EngineArgs(kv_cache_dtype="int4").validate()
    with pytest.raises(ValueError, match=r"--kv-cache-dtype\) fp8: the cpu attention backend"):
        EngineArgs(smollm2_path, device="cpu", dtype="float32", attention_backend="cpu",
                   kv_cache_dtype="fp8").create_engine_config()


@pytest.mark.parametrize("symmetric", [True, False])
def test_compressed_tensors_int4_written_by_the_library(tmp_path, symmetric: bool) -> None:
    """llm-compressor's W4A16 (pack-quantized), written by compressed-tensors: the loaded weights are
    the library's own decompression, and the logits Hugging Face's on those weights."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )

    group = 32
    hf = _tiny_hf()
    args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric)
    apply_quantization_config(hf, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)}, ignore=["lm_head"]))
    for _, m in _projections(hf):
        n, k = m.weight.shape
        w = m.weight.data.reshape(n, k // group, group)
        low, high = w.amin(dim=-1).clamp(max=0), w.amax(dim=-1).clamp(min=0)
        if symmetric:
            m.weight_scale.data = (torch.maximum(-low, high) / 7.5).to(m.weight_scale.dtype)
        else:
            m.weight_scale.data = ((high - low) / 15).to(m.weight_scale.dtype)
            m.weight_zero_point.data = ((-low / m.weight_scale.float()).round() - 8).clamp(-8, 7).to(
                m.weight_zero_point.dtype)
    compressor = ModelCompressor.from_pretrained_model(hf, quantization_format="pack-quantized")
    compressor.compress_model(hf)
    hf.save_pretrained(tmp_path)
    compressor.update_config(str(tmp_path))
    compressor.decompress_model(hf)  # the library's dequantized weights: the reference
    dense_hf = _tiny_hf()
    for (_, m), (_, dense) in zip(_projections(hf), _projections(dense_hf), strict=True):
        dense.weight.data = m.weight.data.float()

    model, method = _load(str(tmp_path))
    assert method == "compressed-tensors"
    down = model.model.layers[1].mlp.down_proj
    assert down.perm is None and down.qweight.dtype == torch.uint8
    weight = dequantize(down.qweight, down.scales, down.zeros, group)
    torch.testing.assert_close(weight, dense_hf.model.layers[1].mlp.down_proj.weight, atol=0, rtol=0)
    _assert_matches_hf(model, dense_hf, 20)


def test_eval_through_a_bound_cache_matches_attention_within_the_window(tmp_path) -> None:
    """`pagellm eval`'s cache path (write the window, attend over the stored entries) gives what
    attending within the window gives, for a cache in the model's dtype."""
    from pagellm.eval.quality import bind_window_cache

    hf = _tiny_hf()
    hf.save_pretrained(tmp_path)
    model, _ = _load(str(tmp_path))
    ids = torch.randint(TINY["vocab_size"], (37,), generator=torch.Generator().manual_seed(1)).tolist()
    within = log_probs(model, ids)
    bind_window_cache(model, 64, torch.float32, CPU)
    torch.testing.assert_close(log_probs(model, ids), within, atol=1e-5, rtol=0)
    bind_window_cache(model, 64, torch.float8_e4m3fn, CPU)
    assert not torch.allclose(log_probs(model, ids), within, atol=1e-5, rtol=0)


@pytest.mark.slow  # a Python process of its own that compiles the kernel for sm_90: seconds
@pytest.mark.parametrize("half", [False, True])
def test_one_row_4bit_kernel_spends_an_and_and_a_multiply_add_a_code(half: bool) -> None:
    """At one row the 4-bit kernel is bound by its instructions: its loop over K (compiled for
    sm_90 here, without a GPU) must keep to one logic op and one multiply-add a code, with no
    float addition a code (as an or'ed-in 2**23 would need); its float16 tiles (HALF) to one
    logic op and one packed multiply-add for two codes, and fewer instructions in all."""
    triton = pytest.importorskip("triton")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not ((tools / "ptxas").exists() and (tools / "cuobjdump").exists()):
        pytest.skip("this Triton has no NVIDIA backend tools: nothing compiles for sm_90 here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gemv_sass", "--block-n", "16", "--block-k", "2048",
                           "--warps", "4", *(["--half"] if half else [])], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ops = {op: int(n) for op, n in (item.split() for item in proc.stdout.strip().splitlines()[-1].split(", "))}
    codes = 16 * 2048 // 128
    if half:
        assert ops["LOP3"] <= 0.6 * codes and ops["HFMA2"] <= 0.6 * codes and ops.get("FFMA", 0) < codes / 8
        assert sum(ops.values()) <= 2.6 * codes
    else:
        assert ops["LOP3"] <= 1.1 * codes and ops["FFMA"] <= 1.1 * codes and ops.get("FADD", 0) < codes / 2
