"""GGUF weights kept quantized: each layer stores the file's own blocks and multiplies with them.

A layer is kept quantized when every checkpoint tensor it is assembled from (q, k and v for the
fused qkv projection) has the same block type with a kernel on the model's device (CPU: Q4_0,
Q4_1, Q8_0; GPU: those and Q4_K, Q6_K), and this rank's share of its input features is whole
blocks; other layers (and the norms) are dequantized at load as before. GGUF blocks are
row-major, so the layers' own weight loaders slice them for tensor parallelism and the loader's
q/k row permutation moves whole rows. On the GPU the loaded blocks are then converted into the
Triton kernel's grouped layout (`gguf_blocks`).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from pagellm.quantization import ggml_cpu, gguf_blocks
from pagellm.quantization.base import LinearMethod, QuantizationConfig

try:  # the GPU's kernel
    from pagellm.quantization import triton_matmul
except ImportError:
    triton_matmul = None

logger = logging.getLogger(__name__)

CPU_TYPES = (gguf_blocks.Q4_0, gguf_blocks.Q4_1, gguf_blocks.Q8_0)
"""The block types the CPU kernels (`ggml_cpu`) take; the GPU takes every type of `gguf_blocks.BLOCKS`."""


class GGUFLinearMethod(LinearMethod):
    """The weight as raw GGUF blocks [output_size, input_size / block values * block bytes]
    (uint8); on the GPU, after loading, as `gguf_blocks.GroupedWeight` parameters."""

    def __init__(self, qtype: int) -> None:
        self.qtype = qtype
        self.grouped: gguf_blocks.GroupedWeight | None = None
        """The GPU layout (shared by the embedding and a tied LM head, whose method this also is)."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        row_bytes = gguf_blocks.row_bytes(self.qtype, input_size)
        layer.weight = nn.Parameter(torch.empty(output_size, row_bytes, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        self.input_size, self.output_size = input_size, output_size
        self.dtype = torch.get_default_dtype()
        """The model's dtype (what an embedding lookup returns)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not layer.weight.is_cuda:
            return
        if self.grouped is None:
            g = gguf_blocks.to_grouped(self.qtype, layer.weight.data, self.input_size)
            frozen = lambda t: None if t is None else nn.Parameter(t, requires_grad=False)  # noqa: E731
            self.grouped = gguf_blocks.GroupedWeight(frozen(g.codes), frozen(g.scale), frozen(g.offset), g.zero,
                                                     g.group)
        g = self.grouped
        layer.weight, layer.scales = g.codes, g.scale
        if g.offset is not None:
            layer.offsets = g.offset

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, self.input_size)
        if x.is_cuda:
            g = self.grouped
            out = triton_matmul.dequant_matmul(x2, g.codes, g.scale, g.zero, g.group, g.offset)
        else:
            # Every batch size takes the kernel: each row is summed alone, in the same order, so a
            # row's result never depends on its batch.
            out = ggml_cpu.gemm(self.qtype, x2.float(), layer.weight, self.output_size)
        if bias is not None:
            out += bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.output_size)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.reshape(-1)
        if ids.is_cuda:
            g = self.grouped
            rows = gguf_blocks.GroupedWeight(g.codes[ids], g.scale[ids], None if g.offset is None else g.offset[ids],
                                             g.zero, g.group)
            return gguf_blocks.dequantize(rows).to(self.dtype)
        return ggml_cpu.dequantize(self.qtype, layer.weight.index_select(0, ids), self.input_size).to(self.dtype)


class GGUFConfig(QuantizationConfig):
    """The block type of every tensor of a GGUF file, by Hugging Face name."""

    name = "gguf"

    def __init__(self, qtypes: dict[str, int]) -> None:
        self.qtypes = qtypes

    @classmethod
    def from_file(cls, path: str) -> "GGUFConfig":
        from pagellm.loader.gguf_file import GGUFFile  # noqa: PLC0415 (the loader imports the layers)
        from pagellm.loader.gguf_loader import hf_tensor_name  # noqa: PLC0415

        with GGUFFile(path) as gguf:
            return cls({hf_tensor_name(t.name): t.ggml_type for t in gguf.tensors})

    def apply(self, model: nn.Module) -> set[str]:
        from pagellm.models.layers import VocabParallelEmbedding  # noqa: PLC0415 (layers import this package)
        from pagellm.models.layers.linear import _ParallelLinear  # noqa: PLC0415

        on_gpu = next(model.parameters()).is_cuda
        types = tuple(gguf_blocks.BLOCKS) if on_gpu else CPU_TYPES
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
            qtype = self._common_type(names, types)
            input_size = module.input_size if isinstance(module, _ParallelLinear) else module.embedding_dim
            if qtype is None or input_size % gguf_blocks.BLOCKS[qtype][0]:
                counts["dequantized"] += 1
                continue
            methods[id(module.weight)] = module
            module.set_quant_method(GGUFLinearMethod(qtype))
            kept.update(names)
            counts["kept quantized"] += 1
        logger.info("GGUF layers: %s", ", ".join(f"{n} {what}" for what, n in counts.items()))
        return kept

    def _common_type(self, names: list[str], kernel_types: tuple[int, ...]) -> int | None:
        """The block type all of `names` share, if the device's kernels take it."""
        types = {self.qtypes.get(name) for name in names}
        qtype = types.pop() if len(types) == 1 else None
        return qtype if qtype in kernel_types else None
