"""int4 weights with a scale and a zero point per group of input features: GPTQ and AutoAWQ
checkpoints, and `rtn` (a dense checkpoint rounded to nearest at load, in the same form, after
activation-aware scales and clipping calibrated at load where the model has a tokenizer:
`smoothing.awq`, `smoothing.clip`).

Whatever the checkpoint's packing, a layer keeps one layout after loading, the one the kernel
reads: `qweight` [N, K / 2] uint8 (input feature k = 2j in byte j's low nibble, 2j + 1 in its high
one), `scales` [N, K / g] float16, `zeros` [N, K / g] uint8, W[n, k] = (q - zero) * scale of k's
group. A GPTQ act-order checkpoint (`desc_act`) numbers its groups in another order than k: its
columns are permuted at load so that groups are contiguous, and each step's activations are
permuted the same way (`perm`).

The checkpoint layouts (the GPTQ and AutoAWQ packers' own):
- GPTQ: qweight int32 [K / 8, N], value k in bits 4 (k % 8) of row k // 8; qzeros int32
  [K / g, N / 8] packed the same way along N, stored minus one (format "gptq"; "gptq_v2" stores
  them as they are); scales [K / g, N]; g_idx int32 [K], the group of each input feature.
- AWQ (GEMM): qweight int32 [K, N / 8], qzeros [K / g, N / 8]: nibble i of a word holds column
  8c + AWQ_ORDER[i]; scales [K / g, N].
- compressed-tensors pack-quantized (llm-compressor's W4A16): weight_packed int32 [N, K / 8],
  value k in bits 4 (k % 8) of word k // 8, stored plus 8 (unsigned); weight_scale [N, K / g];
  weight_zero_point int32 [N / 8, K / g] packed along N, plus 8 (asymmetric only; else zero 8);
  weight_shape [2].
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.config.quantization import FLAG as _FLAG
from pagellm.distributed import get_tp_world_size
from pagellm.layers.linear import RowParallelLinear
from pagellm.layers.linear_method import LinearMethod
from pagellm.quantization import smoothing
from pagellm.quantization.base import (
    Calibration,
    CalibrationSource,
    LinearLayersConfig,
    QuantizableModel,
    new_param,
    replace_param,
)

try:  # the GPU's kernel; the CPU computes the products in PyTorch
    from pagellm.ops.triton import matmul as triton_matmul
except ImportError:
    triton_matmul = None

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble i of an AWQ word holds column 8c + AWQ_ORDER[i] (AutoAWQ's packing order)."""

RTN_GROUP_SIZE = 128


@dataclass(frozen=True, slots=True)
class Int4Format:
    """How a checkpoint's int4 layers are stored."""

    kind: str
    """gptq | awq | compressed-tensors | rtn (a dense checkpoint, quantized at load)."""
    group_size: int = RTN_GROUP_SIZE
    """Input features per scale and zero point; -1: one group per output channel."""
    zeros_minus_one: bool = False
    """GPTQ's format "gptq" (v1): the stored zero points are one less than the real ones."""
    symmetric: bool = False
    """compressed-tensors: no zero points stored (every zero point is 8)."""
    scale_dtype: torch.dtype = torch.float16
    """The checkpoint's scale type, kept as it is (compressed-tensors writes the model's)."""


class Int4LinearMethod(LinearMethod):
    """The layer's weight as int4 groups (see the module docstring)."""

    def __init__(self, fmt: Int4Format) -> None:
        self.fmt = fmt

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        loader, kind = layer.weight_loader, self.fmt.kind
        self.group = input_size if self.fmt.group_size == -1 else self.fmt.group_size
        if kind == "rtn":
            self.group = _rtn_group(input_size)
            layer.weight = new_param((output_size, input_size), torch.get_default_dtype(), loader)
            return
        if input_size % self.group or self.group % 32 or output_size % 8:
            raise ValueError(f"an int4 layer of {input_size} inputs and {output_size} outputs (this rank's) does not "
                             f"split into groups of {self.group} (a multiple of 32) and words of 8 values")
        groups = input_size // self.group
        group_dim = None if self.fmt.group_size == -1 else 0  # one group per output channel: every rank's
        if kind == "compressed-tensors":
            self._create_compressed_tensors(layer, input_size, output_size, groups, group_dim)
            return
        if kind == "gptq":
            layer.qweight = new_param((input_size // 8, output_size), torch.int32, loader, output_dim=1, input_dim=0)
            layer.g_idx = new_param((input_size,), torch.int32, _same_for_every_part(layer), output_dim=None,
                                    input_dim=0)
        else:
            layer.qweight = new_param((input_size, output_size // 8), torch.int32, loader, output_dim=1, input_dim=0)
        layer.qzeros = new_param((groups, output_size // 8), torch.int32, loader, output_dim=1, input_dim=group_dim)
        layer.scales = new_param((groups, output_size), torch.float32, loader, output_dim=1, input_dim=group_dim)

    def _create_compressed_tensors(self, layer: nn.Module, input_size: int, output_size: int, groups: int,
                                   group_dim: int | None) -> None:
        loader = layer.weight_loader
        layer.weight_packed = new_param((output_size, input_size // 8), torch.int32, loader)
        layer.weight_scale = new_param((output_size, groups), torch.float32, loader,
                                       input_dim=None if group_dim is None else 1)
        if not self.fmt.symmetric:
            layer.weight_zero_point = new_param((output_size // 8, groups), torch.int32, loader,
                                                input_dim=None if group_dim is None else 1)
        layer.weight_shape = new_param((2,), torch.int64, _check_shape(layer, input_size), output_dim=None,
                                       input_dim=None)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        perm = None
        if self.fmt.kind == "compressed-tensors":
            q = unpack_rows(layer.weight_packed.data.t()).t()  # [N, K]: packed along K
            scales = layer.weight_scale.data
            zeros = (torch.full_like(scales, 8, dtype=torch.uint8) if self.fmt.symmetric
                     else unpack_rows(layer.weight_zero_point.data))  # [N, K / g]: packed along N
            for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
                if hasattr(layer, name):
                    replace_param(layer, name, None)
        elif self.fmt.kind == "rtn":
            q, scales, zeros = quantize_rtn(layer.weight.data, self.group)
            replace_param(layer, "weight", None)
        else:
            scales = layer.scales.data.t()
            if self.fmt.kind == "gptq":
                q = unpack_rows(layer.qweight.data).t()
                zeros = unpack_rows(layer.qzeros.data.t()).t()  # [K / g, N]: packed along N
                if self.fmt.zeros_minus_one:
                    zeros = (zeros + 1) & 0xF
                perm = _act_order(layer.g_idx.data, self.group)
                if perm is not None:
                    q = q.index_select(1, perm)
            else:
                q = unpack_awq(layer.qweight.data).t()
                zeros = unpack_awq(layer.qzeros.data)
            zeros = zeros.t()
            for name in ("qweight", "qzeros", "scales", "g_idx"):
                if hasattr(layer, name):
                    replace_param(layer, name, None)
        layer.qweight = nn.Parameter(pack_pairs(q.to(torch.uint8)), requires_grad=False)
        layer.scales = nn.Parameter(scales.to(self.fmt.scale_dtype).contiguous(), requires_grad=False)
        layer.zeros = nn.Parameter(zeros.to(torch.uint8).contiguous(), requires_grad=False)
        layer.perm = None if perm is None else nn.Parameter(perm, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)
        if x.is_cuda:
            out = triton_matmul.dequant_matmul(x2, layer.qweight, layer.scales, layer.zeros, self.group)
        else:
            out = F.linear(x2.float(), dequantize(layer.qweight, layer.scales, layer.zeros, self.group)).to(x.dtype)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("int4 methods quantize linear layers only")


def _same_for_every_part(layer: nn.Module):
    """g_idx's loader: the parts of a fused layer (q, k, v; gate, up) share their input, so GPTQ
    gives them one act order; a checkpoint whose parts differ cannot run as one layer."""
    loaded_parts: set[object] = set()

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        before = param.data.clone() if loaded_parts else None
        layer.weight_loader(param, loaded, shard_id)
        if before is not None and not torch.equal(before, param.data):
            raise ValueError("the parts of a fused layer (q/k/v or gate/up projections) have different GPTQ g_idx "
                             "(act orders); pagellm runs them as one layer, which needs one")
        loaded_parts.add(shard_id)

    return load


def _check_shape(layer: nn.Module, input_size: int):
    """weight_shape's loader: the checkpoint's [N, K] must have this layer's K (whole, before any
    row-parallel split); nothing is kept."""
    full = input_size * (get_tp_world_size() if isinstance(layer, RowParallelLinear) else 1)

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if int(loaded[1]) != full:
            raise ValueError(f"a compressed-tensors weight_shape {loaded.tolist()} does not match the layer's "
                             f"{full} input features: does config.json describe the same model as the weights?")

    return load


def _rtn_group(input_size: int) -> int:
    """128 input features per group, or the largest of 64 and 32 that divides a layer's inputs
    (SmolLM2's 576)."""
    group = next((g for g in (RTN_GROUP_SIZE, 64, 32) if input_size % g == 0), None)
    if group is None:
        raise ValueError(f"{_FLAG} rtn: a layer of {input_size} input features (this rank's) does not split into "
                         "groups of 32")
    return group


def _act_order(g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """The input permutation that makes GPTQ's groups contiguous (None: they already are). A
    row-parallel rank holds a slice of g_idx, numbered from its first group."""
    g_idx = g_idx.long() - g_idx.min()
    if torch.equal(g_idx, torch.arange(len(g_idx), device=g_idx.device) // group):
        return None
    if get_tp_world_size() > 1:
        raise ValueError("GPTQ act-order (desc_act) checkpoints run on one rank: pass --tensor-parallel-size 1")
    counts = torch.bincount(g_idx, minlength=len(g_idx) // group)
    if len(counts) != len(g_idx) // group or bool((counts != group).any()):
        raise ValueError(f"a GPTQ g_idx does not give every group {group} input features")
    return torch.argsort(g_idx, stable=True)


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] with eight 4-bit values per word, value 8r + i in bits 4i -> uint8 [8R, C]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    values = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return values.reshape(-1, packed.shape[1]).to(torch.uint8)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ int32 [R, C] -> uint8 [R, 8C] (nibble i of word c is column 8c + AWQ_ORDER[i])."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed[:, :, None] >> shifts) & 0xF  # [R, C, 8], nibble i
    values = torch.empty_like(nibbles)
    values[:, :, list(AWQ_ORDER)] = nibbles
    return values.reshape(packed.shape[0], -1).to(torch.uint8)


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values < 16 -> [N, K / 2]: k = 2j in byte j's low nibble, 2j + 1 in its high one."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_pairs(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_pairs`: [N, K / 2] -> uint8 [N, K]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight [N, K] of the kernel's layout."""
    q = unpack_pairs(qweight)
    zero = zeros.repeat_interleave(group, dim=1).float()
    return (q.float() - zero) * scales.float().repeat_interleave(group, dim=1)


def _rtn_values(weight: torch.Tensor) -> torch.Tensor:
    """What rtn makes of a weight [N, K]: its groups rounded to nearest, as float32 values."""
    n, k = weight.shape
    group = _rtn_group(k)
    q, scales, zeros = quantize_rtn(weight, group)
    q = q.reshape(n, k // group, group).float()
    return ((q - zeros.float()[..., None]) * scales[..., None]).reshape(n, k)


def quantize_rtn(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense [N, K] -> (q uint8 [N, K], scales [N, K / g], zeros uint8 [N, K / g]): each group's
    range [min, max] (widened to hold 0) spread over 0..15, values rounded to nearest."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // group, group)
    low = w.amin(dim=-1).clamp(max=0)
    high = w.amax(dim=-1).clamp(min=0)
    # As stored (float16), so that q matches it; an all-zero group keeps a positive scale.
    scales = ((high - low) / 15).to(torch.float16).float().clamp(min=2**-24)
    zeros = (-low / scales).round().clamp(0, 15)
    q = (w / scales[..., None] + zeros[..., None]).round().clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8), scales, zeros.to(torch.uint8)


def build(method: str, model_path: str, hf_config: dict[str, Any]) -> "Int4Config":
    """The registry's builder of gptq, awq, rtn and 4-bit compressed-tensors (`QuantizationMethod.build`);
    config.json's torch_dtype is the type of the checkpoint's scales."""
    return Int4Config.create(method, hf_config.get("quantization_config") or {},
                             hf_config.get("torch_dtype") or hf_config.get("dtype"))


class Int4Config(LinearLayersConfig):
    """Every linear layer int4 (the embedding and LM head stay dense), but the ignored ones."""

    method_cls = Int4LinearMethod

    def prepare_weights(self, model: QuantizableModel, calibration: CalibrationSource) -> None:
        """rtn: activation-aware scales, then clipping, calibrated on the package's text (AWQ's
        searches: `smoothing.awq`, `smoothing.clip`)."""
        if self.fmt.kind == "rtn":
            def searched(m: nn.Module, c: Calibration) -> str:
                scaled = smoothing.awq(m, c, _rtn_values)
                return f"activation-aware scales for {scaled} layers, clipping for " \
                       f"{smoothing.clip(m, c, _rtn_values, _rtn_group)}"

            smoothing.calibrate(model, calibration, self.name, searched)

    @classmethod
    def create(cls, method: str, qc: dict[str, Any], model_dtype: str | None = None) -> "Int4Config":
        """`method` ("gptq", "awq", "compressed-tensors", "rtn") given the checkpoint's
        `quantization_config` `qc` (and config.json's torch_dtype, the type of its scales)."""
        if method == "rtn":
            return cls("rtn", Int4Format("rtn"))
        if method == "compressed-tensors":
            return cls._compressed_tensors(qc, model_dtype)
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size"))
        if bits != 4:
            raise ValueError(f"{_FLAG} {method}: {bits}-bit weights are not supported; 4-bit are")
        if not isinstance(group, int) or not (group == -1 or group > 0 and group % 32 == 0):
            raise ValueError(f"{_FLAG} {method}: group_size {group!r} is not -1 or a multiple of 32")
        ignored = qc.get("modules_to_not_convert") or ()
        if method == "gptq":
            if qc.get("lm_head"):
                raise ValueError(f"{_FLAG} gptq: a quantized lm_head is not supported")
            fmt = qc.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise ValueError(f"{_FLAG} gptq: checkpoint_format {fmt!r} is neither gptq nor gptq_v2")
            return cls("gptq", Int4Format("gptq", group, zeros_minus_one=fmt == "gptq"), ignored)
        if qc.get("zero_point") is False or str(qc.get("version", "gemm")).lower() != "gemm":
            raise ValueError(f"{_FLAG} awq: pagellm loads AutoAWQ's GEMM layout with zero points, not "
                             f"version {qc.get('version')!r}, zero_point {qc.get('zero_point')!r}")
        return cls("awq", Int4Format("awq", group), ignored)

    @classmethod
    def _compressed_tensors(cls, qc: dict[str, Any], model_dtype: str | None) -> "Int4Config":
        config_group = next(iter(qc["config_groups"].values()))  # one, 4-bit (build_quant_config has checked)
        weights = config_group["weights"]
        strategy, group = weights.get("strategy"), weights.get("group_size")
        if config_group.get("input_activations") is not None:
            raise ValueError(f"{_FLAG} compressed-tensors: 4-bit weights with quantized activations "
                             f"({config_group['input_activations']}) are not supported; W4A16 is")
        if weights.get("type") != "int" or strategy not in ("group", "channel") or (
                strategy == "group" and (not isinstance(group, int) or group <= 0 or group % 32)):
            raise ValueError(f"{_FLAG} compressed-tensors: pagellm loads 4-bit int weights with group (a multiple "
                             f"of 32) or channel scales, not {weights}")
        if qc.get("format") != "pack-quantized":
            raise ValueError(f"{_FLAG} compressed-tensors: 4-bit weights in format {qc.get('format')!r}; pagellm "
                             "loads pack-quantized")
        if weights.get("actorder") not in (None, "weight", "static"):  # these store the weights in order
            raise ValueError(f"{_FLAG} compressed-tensors: actorder {weights.get('actorder')!r} (a stored "
                             "weight_g_idx) is not supported; actorder weight is")
        scale_dtype = {"float16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16}.get(
            model_dtype or "", torch.float32)
        fmt = Int4Format("compressed-tensors", group if strategy == "group" else -1,
                         symmetric=weights.get("symmetric", True), scale_dtype=scale_dtype)
        return cls("compressed-tensors", fmt, qc.get("ignore") or ())
