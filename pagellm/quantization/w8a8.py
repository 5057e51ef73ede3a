"""8-bit weights (float8 e4m3 or int8) with a scale per output channel, from a dense checkpoint
(quantized at load: `--quantization fp8 | int8`) or from an `fp8` / compressed-tensors checkpoint.

Steps of more than `SMALL_BATCH_ROWS` rows quantize each activation row to the same 8-bit type
with its own scale (dynamic, per token) and multiply in 8 bits: `torch._scaled_mm` (fp8) and
`torch._int_mm` (int8) on the GPU. Smaller steps are bound by reading the weights, and 8-bit
activations would only cost accuracy there: they multiply their 16-bit activations with the
8-bit weights (`triton_matmul`). The CPU computes the same two products in float32.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.config.quantization import FLAG as _FLAG
from pagellm.layers.linear_method import LinearMethod
from pagellm.ops.numerics import QMAX
from pagellm.quantization import smoothing
from pagellm.quantization.base import (
    CalibrationSource,
    LinearLayersConfig,
    QuantizableModel,
    new_param,
    per_channel_loader,
    replace_param,
)

try:  # the GPU's kernels; the CPU computes the products in PyTorch
    from pagellm.ops.triton import matmul as triton_matmul
except ImportError:
    triton_matmul = None

logger = logging.getLogger(__name__)

SMALL_BATCH_ROWS = 16
"""Steps of at most this many rows multiply 16-bit activations with the 8-bit weights."""



@dataclass(frozen=True, slots=True)
class W8A8Format:
    """How one checkpoint's (or the flag's) 8-bit layers are stored and multiplied."""

    weight_dtype: torch.dtype
    online: bool
    """Quantize a dense checkpoint's weights at load."""
    quantize_activations: bool = True
    """W8A8 in large steps (False: the checkpoint is weight-only, W8A16)."""
    static_input_scale: bool = False
    """The checkpoint stores a calibrated activation scale per layer (read, then not used: the
    per-token scales are computed per step, which is at least as accurate)."""


class W8A8LinearMethod(LinearMethod):
    """weight [N, K] (8-bit), weight_scale [N] float32: W = weight * weight_scale."""

    def __init__(self, fmt: W8A8Format) -> None:
        self.fmt = fmt

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        loader = layer.weight_loader
        if self.fmt.online:  # dense as stored; quantized once loaded
            layer.weight = new_param((output_size, input_size), torch.get_default_dtype(), loader)
            return
        layer.weight = new_param((output_size, input_size), self.fmt.weight_dtype, loader)
        layer.weight_scale = new_param((output_size,), torch.float32, per_channel_loader(layer), input_dim=None)
        if self.fmt.static_input_scale:
            layer.input_scale = new_param((output_size,), torch.float32, per_channel_loader(layer), input_dim=None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.fmt.online:
            weight, scale = quantize_weight_rows(layer.weight.data, self.fmt.weight_dtype)
            replace_param(layer, "weight", weight)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if self.fmt.static_input_scale:
            replace_param(layer, "input_scale", None)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.fmt.quantize_activations and x2.shape[0] > SMALL_BATCH_ROWS:
            out = w8a8_matmul(x2, layer.weight, layer.weight_scale)
        else:
            out = w8a16_matmul(x2, layer.weight, layer.weight_scale)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("8-bit methods quantize linear layers only")


def quantize_per_row(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (q [R, C] in `dtype`, scale [R] float32) with q * scale ~ x, each row scaled
    so that its largest magnitude is the type's largest value (rounded to nearest)."""
    qmax = QMAX[dtype]
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / qmax
    q = (x.float() / scale).clamp(-qmax, qmax)
    q = q.round().to(dtype) if dtype == torch.int8 else q.to(dtype)
    return q, scale.reshape(-1)


FP8_SCALE_STEPS = 32
"""Float8 weights quantized at load try this many scales a row (below)."""


def quantize_weight_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] -> 8-bit (q, scale [N]), as `quantize_per_row`, but for float8 each
    row takes the scale of max |w| / 448 times 1 + i / FP8_SCALE_STEPS (i < FP8_SCALE_STEPS) whose
    rounded row is nearest the row (least squared error; the largest weight is never clipped).
    e4m3's grid is relative: a scale between two powers of two moves every weight along its
    binade's 8 steps. On SmolLM2's layers the best of 32 such scales cuts the squared error of the
    rounded weights by 11-17% against max / 448 alone (docs/quantization.md has what
    it does to perplexity)."""
    if dtype != torch.float8_e4m3fn:
        return quantize_per_row(w, dtype)
    w32 = w.float()

    def rounding_error(scale: torch.Tensor) -> torch.Tensor:
        return ((w32 / scale).to(dtype).float() * scale - w32).square_().sum(dim=-1, keepdim=True)

    base = w32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / QMAX[dtype]
    best_scale, best_err = base, rounding_error(base)
    for i in range(1, FP8_SCALE_STEPS):
        scale = base * (1 + i / FP8_SCALE_STEPS)
        err = rounding_error(scale)
        better = err < best_err
        best_scale, best_err = torch.where(better, scale, best_scale), torch.where(better, err, best_err)
    return (w32 / best_scale).to(dtype), best_scale.reshape(-1)


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (16/32-bit) @ (weight * weight_scale)^T -> [M, N] in x's dtype."""
    if x.is_cuda:
        return triton_matmul.dequant_matmul(x, weight, weight_scale)
    return ((x.float() @ weight.float().t()) * weight_scale).to(x.dtype)


def w8a8_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x quantized per row to weight's type, multiplied in 8 bits, rescaled -> [M, N] in x's dtype."""
    if x.is_cuda:
        xq, x_scale = triton_matmul.quantize_rows(x, weight.dtype)
    else:
        xq, x_scale = quantize_per_row(x, weight.dtype)
    x_scale = x_scale[:, None]
    if x.is_cuda and weight.dtype == torch.float8_e4m3fn:
        # float32 output needs a recent cuBLAS for row-wise scales: bfloat16, then widened.
        out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
        return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale[None, :],
                                out_dtype=out_dtype).to(x.dtype)
    if x.is_cuda:  # int8: int32 sums, rescaled in float32
        return (torch._int_mm(xq, weight.t()).float() * x_scale * weight_scale).to(x.dtype)
    return ((xq.float() @ weight.float().t()) * x_scale * weight_scale).to(x.dtype)


def build(method: str, model_path: str, hf_config: dict[str, Any]) -> "W8A8Config":
    """The registry's builder of fp8, int8 and 8-bit compressed-tensors (`QuantizationMethod.build`)."""
    return W8A8Config.create(method, hf_config.get("quantization_config") or {})


class W8A8Config(LinearLayersConfig):
    """Every linear layer 8-bit (the embedding and LM head stay dense), but the ignored ones."""

    method_cls = W8A8LinearMethod

    def prepare_weights(self, model: QuantizableModel, calibration: CalibrationSource) -> None:
        """Quantized at load with 8-bit activations: SmoothQuant, calibrated on the package's text."""
        if self.fmt.online and self.fmt.quantize_activations:
            smoothing.calibrate(model, calibration, self.name,
                                lambda m, c: f"SmoothQuant scales for {smoothing.smooth(m, c)} layers")

    @classmethod
    def create(cls, method: str, qc: dict[str, Any]) -> "W8A8Config":
        """The config of `method` ("fp8", "int8", "compressed-tensors") given the checkpoint's
        `quantization_config` `qc` ({} for a dense checkpoint, quantized at load)."""
        if method == "compressed-tensors":
            return cls._compressed_tensors(qc)
        dtype = torch.float8_e4m3fn if method == "fp8" else torch.int8
        if not qc:
            return cls(method, W8A8Format(dtype, online=True))
        if qc.get("weight_block_size"):
            raise ValueError(f"{_FLAG} fp8: block-wise scales (weight_block_size "
                             f"{qc['weight_block_size']}) are not supported; per-tensor and per-channel are")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"{_FLAG} fp8: activation_scheme {scheme!r} is neither dynamic "
                             "nor static")
        return cls(method, W8A8Format(dtype, online=False, static_input_scale=scheme == "static"),
                   qc.get("ignored_layers") or ())

    @classmethod
    def _compressed_tensors(cls, qc: dict[str, Any]) -> "W8A8Config":
        group = next(iter(qc["config_groups"].values()))  # one, 8-bit (build_quant_config has checked)
        weights, inputs = group.get("weights") or {}, group.get("input_activations")
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if bits != 8 or kind not in ("float", "int") or strategy not in ("channel", "tensor") or (
                weights.get("symmetric") is False):
            raise ValueError(f"{_FLAG} compressed-tensors: pagellm loads symmetric 8-bit float "
                             f"or int weights with channel or tensor scales, not {weights}")
        if inputs is not None and inputs.get("num_bits") != 8:
            raise ValueError(f"{_FLAG} compressed-tensors: activations {inputs} are not 8-bit")
        if qc.get("format") not in ("float-quantized", "int-quantized", "naive-quantized"):
            raise ValueError(f"{_FLAG} compressed-tensors: 8-bit weights in format {qc.get('format')!r}; pagellm "
                             "loads float-quantized, int-quantized and naive-quantized")
        fmt = W8A8Format(torch.float8_e4m3fn if kind == "float" else torch.int8, online=False,
                         quantize_activations=inputs is not None,
                         static_input_scale=inputs is not None and not inputs.get("dynamic", False))
        logger.info("compressed-tensors: %s weights, %s scales, %s", kind, strategy,
                    "weight-only" if inputs is None else "8-bit activations per token")
        return cls("compressed-tensors", fmt, qc.get("ignore") or ())
