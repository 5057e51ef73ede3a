"""Quantized weights: the per-layer method seam (`base`) and the formats behind `--quantization`.

| method | weights | from |
|---|---|---|
| fp8 | float8 e4m3, a scale per output channel | a dense checkpoint or GGUF file (at load), or an fp8 one |
| int8 | int8, a scale per output channel | a dense checkpoint or GGUF file, quantized at load |
| compressed-tensors | float8 or int8 as above; int4 as gptq | llm-compressor checkpoints (W8A8 / W8A16; W4A16 packed) |
| gptq, awq | int4, a scale and zero point per group (GPTQ act-order too) | GPTQ / AutoAWQ checkpoints |
| rtn | int4 as gptq/awq, rounded to nearest per group of 128 | a dense checkpoint, quantized at load |
| gguf | a GGUF file's blocks: Q4_0, Q4_1, Q8_0 (CPU, GPU); Q5_0, Q5_1, Q2_K to Q6_K (GPU) | a .gguf file |
| mxfp4 | dense: the experts dequantized at load | a GPT-OSS checkpoint of MXFP4 experts (OpenAI's) |

The 8-bit methods multiply activations quantized per token (W8A8) in steps of more than
`SMALL_BATCH_ROWS` rows and the 16-bit activations directly against the 8-bit weights below it
(reading the weights is what small steps cost); int4 always multiplies 16-bit activations.
Methods that quantize at load first fold per-channel scales calibrated on a short text (`smoothing`):
SmoothQuant for the 8-bit methods' activations, activation-aware scales and clipping for rtn.

The methods are entries of `QUANTIZATION_REGISTRY` (`pagellm.config.quantization`, where the loader
and the planner read it too); `register_quantization_method` adds one.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from pagellm.config.arch import ModelArchConfig
from pagellm.config.quantization import FLAG as _FLAG
from pagellm.config.quantization import (
    QUANTIZATION_REGISTRY,
    QuantizationMethod,
    quantized_weight_bytes,
    register_quantization_method,
)
from pagellm.config.registry import resolve
from pagellm.quantization.base import QuantizationConfig

logger = logging.getLogger(__name__)

__all__ = ["QUANTIZATION_REGISTRY", "QuantizationConfig", "QuantizationMethod",
           "build_quant_config", "check_experts_dense", "checkpoint_quantization", "compressed_tensors_weights",
           "experts_request", "quantized_weight_bytes", "register_quantization_method", "resolve_quantization"]


def checkpoint_quantization(hf_config: dict[str, Any]) -> str | None:
    """The method a Hugging Face config's `quantization_config` names (None: a dense checkpoint),
    in any case ("GPTQ" is gptq, as vLLM reads it)."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    method = method.lower() if isinstance(method, str) else method
    loadable = [e.name for e in QUANTIZATION_REGISTRY.entries() if e.in_checkpoints]
    if method not in loadable:
        raise ValueError(f"the checkpoint's quantization_config has quant_method {method!r}, which pagellm cannot "
                         f"load; it loads {_and(loadable)} checkpoints")
    return method


def resolve_quantization(requested: str | None, load_format: str, model_path: str, device: torch.device,
                         hf_config: dict[str, Any] | None = None, flag: str = _FLAG) -> str | None:
    """The method the engine will use, or None for dense weights in the model's dtype.

    Default: the checkpoint's own `quantization_config`; a GGUF file stays quantized (on the CPU
    when its kernels can run there, else it is dequantized at load, with a warning saying why);
    every other model is dense. A setting that disagrees with the checkpoint is an error. `flag`:
    how errors name the setting (a draft model's is a key of --speculative-config).
    """
    stored = checkpoint_quantization(hf_config or {})
    if requested is None and stored is not None:
        requested = stored
    if stored is not None and requested != stored:
        raise ValueError(f"{flag} is {requested!r}, but {model_path!r} holds {stored} weights (its "
                         f"quantization_config): make it {stored!r} or leave it out")
    if requested == "gguf" or (requested is None and load_format == "gguf"):
        return _resolve_gguf(requested, load_format, model_path, device, flag)
    if requested is None:
        return None
    method = QUANTIZATION_REGISTRY.get(requested)
    if method.from_checkpoint_only and stored is None and load_format != "dummy":
        online = method.dense_alternative
        raise ValueError(f"{flag} {requested!r} loads a checkpoint quantized with {requested}, and {model_path!r} "
                         f"has no such quantization_config"
                         + (f"; to quantize a dense model at load use {online}" if online else ""))
    architectures = (hf_config or {}).get("architectures") or []
    if method.architectures and not set(architectures) & set(method.architectures):
        held = _and(architectures) if architectures else "no architectures list"
        raise ValueError(f"{flag} {requested!r}: pagellm loads {requested} checkpoints of "
                         f"{_and(list(method.architectures))} only, and {model_path!r} holds {held}")
    if method.build is None:  # dense weights (none; mxfp4, dequantized at load)
        return None
    if load_format == "dummy" and (stored is not None or method.from_checkpoint_only):
        raise ValueError(f"{flag} {requested!r} with --load-format dummy: random weights are dense; use fp8, int8 "
                         "or rtn (quantized at load), on a config.json without quantization_config")
    float8 = requested == "fp8" or requested == "compressed-tensors" and compressed_tensors_weights(
        (hf_config or {}).get("quantization_config") or {}).get("type") == "float"
    if device.type == "cuda" and float8 and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{flag} {requested!r}: float8 weights need a GPU of compute capability 8.9 or newer "
                         f"(Ada, Hopper); this one is {torch.cuda.get_device_capability(device)}")
    return requested


def experts_request(requested: str | None, load_format: str, arch: ModelArchConfig) -> str | None:
    """`requested` (--quantization), or "none" for a mixture-of-experts GGUF file with none asked
    for: its blocks are dequantized at load, since expert weights load only dense."""
    if requested is None and load_format == "gguf" and arch.num_experts:
        logger.info("%s is a mixture of experts: its GGUF blocks are dequantized at load", arch.architecture)
        return "none"
    return requested


def check_experts_dense(arch: ModelArchConfig, method: str | None, flag: str = _FLAG) -> str | None:
    """`method` (resolved by `resolve_quantization`), refused for a mixture-of-experts model: its
    experts' weights load only dense so far."""
    if method is not None and arch.num_experts:
        stored = checkpoint_quantization(arch.hf_config)
        why = f"the checkpoint holds {stored} weights (its quantization_config)" if stored else f"{flag} is {method!r}"
        raise ValueError(f"{why}, but {arch.architecture} is a mixture of experts, whose expert weights pagellm "
                         "loads only dense (float32, bfloat16 or float16) so far: load a dense checkpoint"
                         + ("" if stored else f" and leave {flag} out"))
    return method


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _resolve_gguf(requested: str | None, load_format: str, model_path: str, device: torch.device,
                  flag: str) -> str | None:
    if load_format != "gguf":
        raise ValueError(f"{flag} 'gguf' needs a .gguf model, but {model_path!r} is loaded as {load_format}")
    if device.type != "cpu":  # the Triton kernel
        from pagellm.quantization import gguf  # noqa: PLC0415

        if gguf.triton_matmul is not None:
            return "gguf"
        if requested is None:
            logger.warning("Triton cannot be imported; the GGUF weights are dequantized at load instead")
            return None
        raise ValueError(f"{flag} 'gguf' on {device} needs Triton, which cannot be imported here; make "
                         "it 'none'")
    from pagellm.ops.c import ggml as ggml_cpu  # noqa: PLC0415 (builds the kernels on first use)

    reason = ggml_cpu.unavailable_reason()
    if reason is None:
        return "gguf"
    if requested is None:
        logger.warning("%s; the GGUF weights are dequantized at load instead (slower)", reason)
        return None
    raise ValueError(f"{flag} 'gguf' cannot run here: {reason}; make it 'none'")


def build_quant_config(method: str | None, model_path: str,
                       hf_config: dict[str, Any] | None = None) -> QuantizationConfig | None:
    """The per-layer config of a resolved `method` for the model at `model_path` (None: dense)."""
    if method is None:
        return None
    build = QUANTIZATION_REGISTRY.get(method).build
    return None if build is None else resolve(build)(method, model_path, hf_config or {})


def compressed_tensors_weights(qc: dict[str, Any]) -> dict[str, Any]:
    """The weights' arguments of a compressed-tensors config, checked for what every format here
    needs: one config group, 4 or 8 bits, no KV-cache scheme."""
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise ValueError(f"{_FLAG} compressed-tensors: {len(groups)} config groups; pagellm loads checkpoints "
                         "with one (every Linear layer the same way)")
    kv = qc.get("kv_cache_scheme")
    if kv and (kv.get("type") != "float" or kv.get("num_bits") != 8 or kv.get("strategy") != "tensor"
               or kv.get("dynamic")):
        raise ValueError(f"{_FLAG} compressed-tensors: kv_cache_scheme {kv}; pagellm reads float8 KV caches with "
                         "static per-tensor scales (type float, num_bits 8, strategy tensor)")
    weights = groups[0].get("weights") or {}
    if weights.get("num_bits") not in (4, 8):
        raise ValueError(f"{_FLAG} compressed-tensors: {weights.get('num_bits')}-bit weights are not supported; "
                         "8-bit (float or int) and 4-bit int are")
    return weights
