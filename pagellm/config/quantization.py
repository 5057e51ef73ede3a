"""The quantization methods `--quantization` takes, one table (`QUANTIZATION_REGISTRY`): what each
builds, whether it needs a checkpoint quantized with it, how checkpoints name it, and its bytes
per weight for capacity planning (`pagellm plan`).

The table lives here, below the implementations (`pagellm.quantization`), because the loader
reads it too (which method an old checkpoint's own settings file describes).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagellm.config.registry import Registry, check_ref

FLAG = "quantization (--quantization)"
"""How errors name the flag (and LLM(...)'s keyword)."""

INT4_GROUP_SIZE = 128
"""Weights per scale (and zero point) in GPTQ and AWQ checkpoints, the common choice."""
_INT4_GROUP_OVERHEAD_BYTES = 2 + 1
"""Per group of INT4_GROUP_SIZE weights: a 16-bit scale and a zero point (a byte, as the engine keeps it)."""
INT4_BYTES_PER_WEIGHT = 0.5 + _INT4_GROUP_OVERHEAD_BYTES / INT4_GROUP_SIZE
"""4 bits plus a scale and a zero point per group of 128 weights (gptq, awq, rtn)."""


@dataclass(frozen=True, slots=True)
class QuantizationMethod:
    """A `--quantization` method (`pagellm.quantization.register_quantization_method` adds one)."""

    name: str
    build: Any
    """(method, model_path, hf_config) -> its `pagellm.quantization.QuantizationConfig` (which
    method each layer gets), or its "package.module:function" name; None: dense weights."""
    description: str = ""
    """What `--help` says of it."""
    from_checkpoint_only: bool = False
    """Its weights must come quantized in the checkpoint (it cannot quantize a dense model at load)."""
    in_checkpoints: bool = False
    """A checkpoint's `quantization_config` may name it (`quant_method`), which then selects it."""
    bytes_per_weight: float | None = None
    """What a linear layer's weight costs stored with it, for `pagellm plan`; None: the model's
    dtype for a method that builds nothing (none), else set by the checkpoint (the planner reads it)."""
    dense_alternative: str | None = None
    """For a method that needs a quantized checkpoint: what quantizes a dense model at load instead."""
    legacy_settings: Callable[[dict[str, Any]], bool] | None = None
    """Whether a settings file older than transformers' `quantization_config`, found beside
    config.json without a `quant_method` (AutoGPTQ's quantize_config.json, AutoAWQ's
    quant_config.json), describes a checkpoint of this method."""
    architectures: tuple[str, ...] = ()
    """The architectures whose checkpoints of this method load (empty: any)."""


def _autoawq_settings(settings: dict[str, Any]) -> bool:
    return "w_bit" in settings or "version" in settings  # AutoAWQ names its bits w_bit and its kernel version


def _autogptq_settings(settings: dict[str, Any]) -> bool:
    return not _autoawq_settings(settings)  # AutoGPTQ's may name no method at all


QUANTIZATION_REGISTRY: Registry[QuantizationMethod] = Registry("quantization method", FLAG, builtins=(
    QuantizationMethod(
        "fp8", "pagellm.quantization.w8a8:build",
        "float8 e4m3, a scale per output channel: a dense checkpoint quantized at load, or an fp8 checkpoint; "
        "8-bit activations per token in steps of more than 16 rows", in_checkpoints=True, bytes_per_weight=1.0),
    QuantizationMethod("int8", "pagellm.quantization.w8a8:build", "the same in int8, quantized at load",
                       bytes_per_weight=1.0),
    QuantizationMethod(
        "compressed-tensors", "pagellm.quantization.compressed_tensors:build",
        "llm-compressor checkpoints: float8/int8 W8A8 or W8A16, int4 W4A16 pack-quantized",
        from_checkpoint_only=True, in_checkpoints=True, dense_alternative="fp8 or int8"),
    QuantizationMethod(
        "gptq", "pagellm.quantization.int4:build",
        "int4 GPTQ checkpoints: a scale and zero point per group, act-order too", from_checkpoint_only=True,
        in_checkpoints=True, bytes_per_weight=INT4_BYTES_PER_WEIGHT, dense_alternative="rtn",
        legacy_settings=_autogptq_settings),
    QuantizationMethod(
        "awq", "pagellm.quantization.int4:build", "int4 AutoAWQ checkpoints: a scale and zero point per group",
        from_checkpoint_only=True, in_checkpoints=True, bytes_per_weight=INT4_BYTES_PER_WEIGHT,
        dense_alternative="rtn", legacy_settings=_autoawq_settings),
    QuantizationMethod(
        "rtn", "pagellm.quantization.int4:build",
        "int4 groups of 128 rounded to nearest at load after AWQ's activation-aware scales and clipping, "
        "GPTQ/AWQ's kernels", bytes_per_weight=INT4_BYTES_PER_WEIGHT),
    QuantizationMethod(
        "gguf", "pagellm.quantization.gguf:build",
        "a GGUF file's blocks kept quantized: Q4_0/Q4_1/Q8_0 on the CPU, those and Q5_0/Q5_1/Q2_K/Q3_K/Q4_K/Q5_K/"
        "Q6_K on the GPU, where it decodes faster than dense weights; other types dequantized at load"),
    QuantizationMethod(
        "mxfp4", None, "GPT-OSS checkpoints' MXFP4 experts, dequantized to --dtype at load (4x their stored memory)",
        from_checkpoint_only=True, in_checkpoints=True, architectures=("GptOssForCausalLM",)),
    QuantizationMethod("none", None, "dense in --dtype"),
))
"""Every `--quantization` method (vLLM's names), in `--help`'s order."""


def register_quantization_method(name: str, build: Callable[..., Any] | str, *, description: str = "",
                                 from_checkpoint_only: bool = False, in_checkpoints: bool = False,
                                 bytes_per_weight: float | None = None, dense_alternative: str | None = None,
                                 legacy_settings: Callable[[dict[str, Any]], bool] | None = None,
                                 architectures: tuple[str, ...] = (), override: bool = False) -> None:
    """Make `name` a `--quantization` method: `build(method, model_path, hf_config)` returns the
    `QuantizationConfig` that gives the model's layers their quantized linear methods (see
    `QuantizationMethod` for the other fields). A name already registered is refused unless
    `override`."""
    check_ref(build, f"register_quantization_method({name!r}) build")
    if not isinstance(build, str) and not callable(build):
        raise ValueError(f"register_quantization_method({name!r}): build must be callable, got {build!r}")
    if bytes_per_weight is not None and not (isinstance(bytes_per_weight, (int, float)) and bytes_per_weight > 0):
        raise ValueError(f"register_quantization_method({name!r}): bytes_per_weight must be a number > 0, "
                         f"got {bytes_per_weight!r}")
    QUANTIZATION_REGISTRY.register(QuantizationMethod(
        name, build, description, from_checkpoint_only, in_checkpoints,
        None if bytes_per_weight is None else float(bytes_per_weight), dense_alternative, legacy_settings,
        tuple(architectures)), override=override)


def quantized_weight_bytes(method: str, dtype_bytes: int) -> float:
    """Bytes per weight of a linear layer stored with `method` ("none": the model dtype)."""
    entry = QUANTIZATION_REGISTRY.get(method)
    if entry.bytes_per_weight is not None:
        return entry.bytes_per_weight
    if entry.build is None:
        return float(dtype_bytes)
    sized = [e.name for e in QUANTIZATION_REGISTRY.entries() if e.bytes_per_weight is not None or e.build is None]
    raise ValueError(f"no size per weight for quantization {method!r}: {', '.join(sized)}")


def legacy_settings_method(settings: dict[str, Any]) -> str | None:
    """The method an old checkpoint's settings file without `quant_method` describes (None: none says)."""
    return next((e.name for e in QUANTIZATION_REGISTRY.entries()
                 if e.legacy_settings is not None and e.legacy_settings(settings)), None)
