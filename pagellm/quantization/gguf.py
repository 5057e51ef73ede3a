"""GGUF weights kept quantized: each layer stores the file's own blocks and multiplies with them.

A layer is kept quantized when every checkpoint tensor it is assembled from (q, k and v for the
fused qkv projection) has the same block type with a kernel on the model's device (CPU: Q4_0,
Q4_1, Q8_0; GPU: those and Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; on the GPU a fused layer's
parts may also differ in type), and this rank's share of its input features is whole blocks; other
layers (and the norms) are dequantized at load as before. GGUF blocks are
row-major, so the layers' own weight loaders slice them for tensor parallelism and the loader's
q/k row permutation moves whole rows. On the GPU the loaded blocks are then converted into the
Triton kernel's grouped layout (`gguf_blocks`).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from pagellm.layers.embedding import VocabParallelEmbedding
from pagellm.layers.linear import _ParallelLinear
from pagellm.layers.linear_method import LinearMethod
from pagellm.loader.gguf_file import GGUFFile
from pagellm.loader.gguf_loader import hf_tensor_name
from pagellm.ops.c import ggml as ggml_cpu
from pagellm.quantization import gguf_blocks
from pagellm.quantization.base import QuantizableModel, QuantizationConfig

try:  # the GPU's kernel
    from pagellm.ops.triton import matmul as triton_matmul
except ImportError:
    triton_matmul = None

logger = logging.getLogger(__name__)

CPU_TYPES = (gguf_blocks.Q4_0, gguf_blocks.Q4_1, gguf_blocks.Q8_0)
"""The block types the CPU kernels (`ggml_cpu`) take; the GPU takes every type of `gguf_blocks.BLOCKS`."""


class GGUFLinearMethod(LinearMethod):
    """The weight as raw GGUF blocks [output_size, input_size / block values * block bytes]
    (uint8); on the GPU, after loading, as `gguf_blocks.GroupedWeight` parameters.

    On the GPU a fused layer's parts may differ in type (`part_types`: llama.cpp's Q4_K_M stores
    q and k as Q4_K, v as Q6_K): each part's blocks are loaded into its rows of a buffer as wide as
    the widest part's, and each run of parts of one type becomes its own layout and product,
    written into its columns of the output.
    """

    def __init__(self, qtype: int | None, part_types: dict[object, int] | None = None) -> None:
        self.qtype = qtype
        """The block type (None: the parts differ)."""
        self.part_types = part_types
        self.runs: list[tuple[int, int, gguf_blocks.GroupedWeight]] = []
        """GPU: (first row, rows, layout) of each run of parts of one type (shared by the embedding
        and a tied LM head, whose method this also is)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        types = self.part_types.values() if self.part_types else (self.qtype,)
        row_bytes = max(gguf_blocks.row_bytes(t, input_size) for t in types)
        layer.weight = nn.Parameter(torch.empty(output_size, row_bytes, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = _padding_loader(layer) if self.part_types else layer.weight_loader
        self.input_size, self.output_size = input_size, output_size
        self.dtype = torch.get_default_dtype()
        """The model's dtype (what an embedding lookup returns)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if layer.weight.is_cuda:
            self.convert(layer)

    def convert(self, layer: nn.Module) -> None:
        """The loaded blocks -> the Triton kernel's layout, one per run of parts of one type (the
        GPU's form; `apply` then takes the kernel on any device: the CPU's tests run it in Triton's
        interpreter)."""
        if not self.runs:
            raw = layer.weight.data
            for start, rows, qtype in self._type_runs(layer):
                blocks = raw[start:start + rows, :gguf_blocks.row_bytes(qtype, self.input_size)]
                g = gguf_blocks.to_grouped(qtype, blocks, self.input_size)
                self.runs.append((start, rows, gguf_blocks.GroupedWeight(
                    _frozen(g.codes), _frozen(g.scale), _frozen(g.offset), g.zero, g.group)))
        if "weight" in layer._parameters:  # (a tied table's second module: its own name for the blocks)
            delattr(layer, "weight")
        for i, (_, _, g) in enumerate(self.runs):
            suffix = "" if len(self.runs) == 1 else f"_{i}"
            setattr(layer, f"weight{suffix}", g.codes)
            setattr(layer, f"scales{suffix}", g.scale)
            if g.offset is not None:
                setattr(layer, f"offsets{suffix}", g.offset)

    def _type_runs(self, layer: nn.Module) -> list[tuple[int, int, int]]:
        """(first row, rows, type) of each run of consecutive parts of one block type."""
        if not self.part_types:
            return [(0, self.output_size, self.qtype)]
        runs: list[tuple[int, int, int]] = []
        for shard_id, start, rows in layer.parts():
            qtype = self.part_types[shard_id]
            if runs and runs[-1][2] == qtype:
                runs[-1] = (runs[-1][0], runs[-1][1] + rows, qtype)
            else:
                runs.append((start, rows, qtype))
        return runs

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.input_size)
        if not self.runs:  # the CPU's kernels
            # Every batch size takes the kernel: each row is summed alone, in the same order, so a
            # row's result never depends on its batch.
            out = ggml_cpu.gemm(self.qtype, x2.float(), layer.weight, self.output_size).to(x.dtype)
        else:  # the Triton kernel, each run of one type into its columns
            out = torch.empty(x2.shape[0], self.output_size, dtype=x.dtype, device=x.device)
            for start, rows, g in self.runs:
                triton_matmul.dequant_matmul(x2, g.codes, g.scale, g.zero, g.group, g.offset,
                                             out=out[:, start:start + rows])
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], self.output_size)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        if self.runs:
            g = self.runs[0][2]  # a table is one tensor
            rows = gguf_blocks.GroupedWeight(g.codes[ids], g.scale[ids], None if g.offset is None else g.offset[ids],
                                             g.zero, g.group)
            return gguf_blocks.dequantize(rows).to(self.dtype)
        return ggml_cpu.dequantize(self.qtype, layer.weight.index_select(0, ids), self.input_size).to(self.dtype)


def _frozen(t: torch.Tensor | None) -> nn.Parameter | None:
    return None if t is None else nn.Parameter(t, requires_grad=False)


def _padding_loader(layer: nn.Module):
    """A mixed layer's loader: each part's blocks, zero-padded to the buffer's width, into its rows."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        padded = loaded.new_zeros(loaded.shape[0], param.shape[1])
        padded[:, :loaded.shape[1]] = loaded
        layer.weight_loader(param, padded, shard_id)

    return load


def build(method: str, model_path: str, hf_config: dict) -> "GGUFConfig":
    """The registry's builder of gguf (`QuantizationMethod.build`): the file's block types."""
    return GGUFConfig.from_file(model_path)


class GGUFConfig(QuantizationConfig):
    """The block type of every tensor of a GGUF file, by Hugging Face name."""

    name = "gguf"

    def __init__(self, qtypes: dict[str, int]) -> None:
        self.qtypes = qtypes

    @classmethod
    def from_file(cls, path: str) -> "GGUFConfig":
        with GGUFFile(path) as gguf:
            arch = gguf.metadata.get("general.architecture")
            return cls({hf_tensor_name(t.name, arch): t.ggml_type for t in gguf.tensors})

    def apply(self, model: QuantizableModel) -> set[str]:
        on_gpu = next(model.parameters()).is_cuda
        kept: set[str] = set()
        methods: dict[int, nn.Module] = {}  # id(original weight) -> the module that re-created it (tied tables)
        counts: Counter[str] = Counter()
        for prefix, module in model.named_modules():
            if not isinstance(module, (_ParallelLinear, VocabParallelEmbedding)):
                continue
            shared = methods.get(id(module.weight))
            if shared is not None:
                module.set_quant_method(shared.quant_method, shared=shared)
                continue
            names = model.checkpoint_names(f"{prefix}.weight")
            method = self.method_for(module, names, on_gpu)
            if method is None:
                counts["dequantized"] += 1
                continue
            methods[id(module.weight)] = module
            module.set_quant_method(method)
            kept.update(names)
            counts["kept quantized"] += 1
        logger.info("GGUF layers: %s", ", ".join(f"{n} {what}" for what, n in counts.items()))
        return kept

    def method_for(self, module: nn.Module, names: list[str], on_gpu: bool) -> GGUFLinearMethod | None:
        """The method of a layer (or vocabulary table) stacked from checkpoint tensors `names`, if
        the device's kernels take their block types (one type; on the GPU also one per fused part)
        and this rank's input features are whole blocks; else None (dequantized at load)."""
        kernel_types = tuple(gguf_blocks.BLOCKS) if on_gpu else CPU_TYPES
        types = [self.qtypes.get(name) for name in names]
        input_size = module.input_size if isinstance(module, _ParallelLinear) else module.embedding_dim
        if not all(t in kernel_types and input_size % gguf_blocks.BLOCKS[t][0] == 0 for t in types):
            return None
        if len(set(types)) == 1:
            return GGUFLinearMethod(types[0])
        if not on_gpu:
            return None
        parts = module.parts()  # in the order of `names` (the model's stacking order)
        return GGUFLinearMethod(None, {shard_id: t for (shard_id, _, _), t in zip(parts, types, strict=True)})


def kept_weight_bytes(method: GGUFLinearMethod, module: nn.Module, on_gpu: bool) -> int:
    """Bytes of `module`'s dense [rows, inputs] weight once `method` keeps it (not yet given to the
    module) on the CPU (the file's blocks) or the GPU."""
    rows, inputs = module.weight.shape
    parts = [(rows, method.qtype)] if method.part_types is None else \
        [(part_rows, method.part_types[shard_id]) for shard_id, _, part_rows in module.parts()]
    return sum(round(n * inputs * gguf_blocks.bytes_per_weight(t, on_gpu)) for n, t in parts)
