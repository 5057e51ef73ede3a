"""SmoothQuant at load, for 8-bit activations quantized per token (`--quantization int8 | fp8` on a
dense checkpoint or GGUF file).

The input of a layer after an RMSNorm has a few channels far larger than the rest (the norm's
weight makes them so, in every token): a token's one 8-bit scale then leaves the other channels
few levels. Dividing channel j of the norm's weight by s_j and multiplying column j of the layer's
weight by s_j computes the same product with flatter activations; s_j = max|X_j|^a / max|W_j|^(1-a)
shares the range between the two (Xiao et al., 2023; a = 0.5, their default). max|X_j| is measured
on a short calibration text that ships with the package (not the `pagellm eval` sample).
On SmolLM2-135M, int8 W8A8's mean KL from the dense model halves (see the README's eval table).
"""
from __future__ import annotations

import logging
from importlib import resources

import torch
from torch import nn

from pagellm.quantization.base import UnquantizedLinearMethod

logger = logging.getLogger(__name__)

ALPHA = 0.5
"""How much of each channel's range moves into the weights."""
CALIBRATION_TOKENS = 512
"""Tokens of the calibration text run through the model."""
_MIN = 1e-5
"""Floor of the measured maxima: a channel never active in calibration is not divided by ~0."""


def calibration_ids(tokenizer) -> list[int]:
    """The calibration text's first `CALIBRATION_TOKENS` tokens."""
    text = resources.files("pagellm.quantization").joinpath("calibration.txt").read_text(encoding="utf-8")
    return tokenizer.encode(text)[:CALIBRATION_TOKENS]


def smooth(model: nn.Module, ids: list[int], alpha: float = ALPHA) -> int:
    """Measure the inputs of each decoder layer's smoothable linear layers on `ids` (dense products)
    and fold the scales into them and their norms; returns how many layers were smoothed (0: none,
    when a measured maximum or a scale is not finite). Every tensor-parallel rank runs this alike
    (the forward's collectives keep them in step). A rank's scales depend on its own rows of the
    weight (their largest magnitudes), so they differ between ranks; each folds its own into its
    own copy of the norm, whose output only its own rows read: the product stays exact."""
    pairs = [pair for layer in model.decoder_layers() for pair in layer.smoothable()]
    maxima = input_maxima(model, [linear for _, linear in pairs], ids)
    scales = [scale(maxima[linear], linear.weight.data, alpha) for _, linear in pairs]
    if not all(bool(s.isfinite().all()) for s in scales):
        logger.warning("SmoothQuant calibration gave non-finite activations or scales; the layers are left as loaded")
        return 0
    for (norm, linear), s in zip(pairs, scales):
        fold(norm, linear, s)
    return len(pairs)


def input_maxima(model: nn.Module, layers: list[nn.Module], ids: list[int]) -> dict[nn.Module, torch.Tensor]:
    """max |x_j| per input channel of each of `layers` over `ids`, every linear layer multiplying
    its dense weight (the quantized methods have not processed them yet)."""
    from pagellm.eval.quality import hidden_states  # noqa: PLC0415 (eval imports the worker, which imports us)

    maxima: dict[nn.Module, torch.Tensor] = {}

    def record(layer: nn.Module, args: tuple) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
        maxima[layer] = torch.maximum(maxima[layer], x) if layer in maxima else x

    hooks = [layer.register_forward_pre_hook(record) for layer in layers]
    # Layers whose weights are still dense multiply them as such; any other keeps its method.
    methods = {m: m.quant_method for m in model.modules()
               if hasattr(m, "quant_method") and m.weight.is_floating_point()}
    dense = UnquantizedLinearMethod()
    try:
        for module in methods:
            module.quant_method = dense
        hidden_states(model, ids, next(model.parameters()).device)
    finally:
        for module, method in methods.items():
            module.quant_method = method
        for hook in hooks:
            hook.remove()
    return maxima


def scale(x_max: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = max|X_j|^alpha / max|W_j|^(1 - alpha) for a weight [N, K]."""
    return x_max.clamp(min=_MIN) ** alpha / weight.float().abs().amax(dim=0).clamp(min=_MIN) ** (1 - alpha)


def fold(norm: nn.Module, linear: nn.Module, s: torch.Tensor) -> None:
    """norm.weight / s and linear.weight * s, per input channel j."""
    norm.weight.data = (norm.weight.data.float() / s).to(norm.weight.dtype)
    linear.weight.data = (linear.weight.data.float() * s).to(linear.weight.dtype)
