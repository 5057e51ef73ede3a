"""Per-channel scales folded between a norm and the layer that reads it, calibrated at load for the
methods that quantize a dense checkpoint or GGUF file (`--quantization int8 | fp8 | rtn`).

Dividing channel j of an RMSNorm's weight by s_j and multiplying column j of the next layer's
weight by s_j computes the same product; the choice of s decides what quantization loses.
- SmoothQuant (int8, fp8: 8-bit activations per token): the input of a layer after a norm has a
  few channels far larger than the rest in every token, and a token's one 8-bit scale leaves the
  others few levels. s_j = max|X_j|^a / max|W_j|^(1-a) shares the range between activations and
  weights (Xiao et al., 2023; a = 0.5, their default).
- Activation-aware scaling (rtn: 4-bit weights, 16-bit activations): the columns that meet large
  inputs matter most to the product, so they get more of the 4-bit grid. s_j = mean|X_j|^a, with
  a from a grid chosen per layer to minimise the product's error on the calibration inputs (the
  search of AWQ, Lin et al., 2024); then each group of a row keeps the fraction of its range whose
  rounding errs least on the calibration inputs (AWQ's clipping search, both ends of the range
  shrunk), in the layers of each decoder layer's `clippable()`.
The inputs are measured on a short text that ships with the package (not the `pagellm eval`
sample). The layers: each decoder layer's `smoothable()` pairs (qkv after the input norm, gate_up
after the post-attention norm).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from importlib import resources

import torch
from torch import nn

from pagellm.layers.linear_method import UnquantizedLinearMethod
from pagellm.quantization.base import Calibration, CalibrationSource, QuantizableModel

logger = logging.getLogger(__name__)

ALPHA = 0.5
"""SmoothQuant: how much of each channel's range moves into the weights."""
AWQ_GRID = tuple(i / 10 for i in range(11))
"""Activation-aware scaling: the exponents tried per layer (0: no scaling)."""
CLIP_GRID = tuple(1 - i / 20 for i in range(10))
"""The fractions of a group's range tried by the clipping search (1: unclipped)."""
CLIP_ELEMENTS = 1 << 24
"""Weights searched at once (whole rows): bounds the search's memory on large layers."""
SEARCH_STRIDE = 4
"""The searches judge each candidate on every SEARCH_STRIDE-th calibration token."""
CALIBRATION_TOKENS = 512
"""Tokens of the calibration text run through the model."""
_MIN = 1e-5
"""Floor of the measured statistics: a channel never active in calibration is not divided by ~0."""


def calibrate(model: QuantizableModel, source: CalibrationSource, method: str,
              search: Callable[[nn.Module, Calibration], str]) -> None:
    """Run `search(model, calibration)` (`smooth`; `awq` and `clip` with the method's rounding) on
    the package's calibration text (at most `CALIBRATION_TOKENS` of it) where the model can be
    calibrated, and log the summary it returns."""
    text = resources.files("pagellm.quantization").joinpath("calibration.txt").read_text(encoding="utf-8")
    calibration = source(text)
    if calibration is None:
        return
    calibration = Calibration(calibration.token_ids[:CALIBRATION_TOKENS], calibration.forward)
    start = time.perf_counter()
    summary = search(model, calibration)
    logger.info("%s: %s, calibrated in %.2f s", method, summary, time.perf_counter() - start)


def smooth(model: QuantizableModel, calibration: Calibration, alpha: float = ALPHA) -> int:
    """SmoothQuant: measure the inputs of the smoothable layers on the calibration prompt and fold their scales;
    returns how many layers were smoothed (0: none, when a statistic or scale is not finite).
    Every tensor-parallel rank runs this alike (the forward's collectives keep them in step). A
    rank's scales depend on its own rows of the weight, so they differ between ranks; each folds
    its own into its own copy of the norm, whose output only its own rows read: exact again."""
    pairs = _pairs(model)
    inputs = layer_inputs(model, [linear for _, linear in pairs], calibration)
    return _fold_all(pairs, [scale(inputs[linear].abs().amax(dim=0), linear.weight.data, alpha)
                             for _, linear in pairs])


def awq(model: QuantizableModel, calibration: Calibration, fake_quantize: Callable[[torch.Tensor], torch.Tensor],
        grid: tuple[float, ...] = AWQ_GRID) -> int:
    """Activation-aware scaling for weights that `fake_quantize` ([N, K] float32 -> its quantized
    values) will round: per smoothable layer, the exponent of `grid` whose scales give the smallest
    error of the product on the calibration inputs is folded; returns how many layers were scaled."""
    pairs = _pairs(model)
    inputs = layer_inputs(model, [linear for _, linear in pairs], calibration)
    scales = []
    for _, linear in pairs:
        x, weight = inputs[linear], linear.weight.data.float()
        mean = x.abs().mean(dim=0).clamp(min=_MIN)
        x = x[::SEARCH_STRIDE]  # the error of a product is judged on a sample of the tokens
        exact = x @ weight.t()
        best = None
        for a in grid:
            s = mean ** a
            s = s / (s.max() * s.min()).sqrt()  # centred on 1 (in log): the weights keep their magnitude
            error = (x @ (fake_quantize(weight * s) / s).t() - exact).square().mean().item()
            if best is None or error < best[0]:
                best = (error, s)
        scales.append(best[1])
    return _fold_all(pairs, scales)


def clip(model: QuantizableModel, calibration: Calibration, fake_quantize: Callable[[torch.Tensor], torch.Tensor],
         group_of: Callable[[int], int], grid: tuple[float, ...] = CLIP_GRID) -> int:
    """AWQ's clipping search for weights that `fake_quantize` rounds in groups of `group_of(K)`
    inputs (the same groups), each to its own range [min, max]: per row and group of each
    clippable layer, the fraction of the range whose rounded product with the calibration inputs
    errs least; the weights are clamped to it. Returns the layers searched. (AWQ clamps to
    +-r max|w|; with a zero point per group, as here, both ends of the range shrink by r instead.)"""
    layers = [linear for layer in model.decoder_layers() for linear in layer.clippable()]
    inputs = layer_inputs(model, layers, calibration)
    if not all(bool(x.isfinite().all()) for x in inputs.values()):
        logger.warning("calibration gave non-finite activations; the weights are not clipped")
        return 0
    for linear in layers:
        weight = linear.weight.data
        n, k = weight.shape
        group = group_of(k)
        x = inputs[linear][::SEARCH_STRIDE].reshape(-1, k // group, group)
        chunk = max(1, CLIP_ELEMENTS // k)
        for rows in range(0, n, chunk):
            w = weight[rows:rows + chunk].float()
            groups = w.reshape(-1, k // group, group)
            low = groups.amin(dim=-1, keepdim=True).clamp(max=0)
            high = groups.amax(dim=-1, keepdim=True).clamp(min=0)
            best = best_error = None
            for r in grid:
                clipped = torch.minimum(torch.maximum(groups, low * r), high * r)
                delta = groups - fake_quantize(clipped.reshape(w.shape)).reshape(groups.shape)
                error = torch.einsum("tgi,ngi->tng", x, delta).square().mean(dim=0)  # [rows, groups]
                if best is None:
                    best, best_error = clipped, error
                    continue
                better = error < best_error
                best_error = torch.where(better, error, best_error)
                best = torch.where(better[..., None], clipped, best)
            weight[rows:rows + chunk] = best.reshape(w.shape).to(weight.dtype)
    return len(layers)


def layer_inputs(model: QuantizableModel, layers: list[nn.Module],
                 calibration: Calibration) -> dict[nn.Module, torch.Tensor]:
    """Each of `layers`' inputs [tokens, K] (float32) over the calibration prompt, every layer whose
    weight is still dense multiplying it as such (the quantized methods have not processed the
    weights yet)."""
    inputs: dict[nn.Module, torch.Tensor] = {}

    def record(layer: nn.Module, args: tuple) -> None:
        inputs[layer] = args[0].reshape(-1, args[0].shape[-1]).float()

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    methods = {m: m.quant_method for m in model.modules()
               if hasattr(m, "quant_method") and m.weight.is_floating_point()}
    dense = UnquantizedLinearMethod()
    try:
        for module in methods:
            module.quant_method = dense
        calibration.forward(model, calibration.token_ids)
    finally:
        for module, method in methods.items():
            module.quant_method = method
        for hook in hooks:
            hook.remove()
    return inputs


def scale(x_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s [K] = max|X_j|^alpha / max|W_j|^(1 - alpha) for a weight [N, K]."""
    return x_max.clamp(min=_MIN) ** alpha / weight.float().abs().amax(dim=0).clamp(min=_MIN) ** (1 - alpha)


def fold(norm: nn.Module, linear: nn.Module, s: torch.Tensor) -> None:
    """norm.weight / s and linear.weight * s, per input channel j."""
    norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
    linear.weight.data = (linear.weight.data.float() * s).to(linear.weight.dtype)


def _pairs(model: QuantizableModel) -> list[tuple[nn.Module, nn.Module]]:
    return [pair for layer in model.decoder_layers() for pair in layer.smoothable()]


def _fold_all(pairs: list[tuple[nn.Module, nn.Module]], scales: list[torch.Tensor]) -> int:
    if not all(bool(s.isfinite().all()) for s in scales):
        logger.warning("calibration gave non-finite activations or scales; the layers are left as loaded")
        return 0
    for (norm, linear), s in zip(pairs, scales):
        fold(norm, linear, s)
    return len(pairs)
