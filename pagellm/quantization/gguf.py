"""GGUF weights kept quantized: each layer stores the file's own blocks and multiplies with them.

A layer is kept quantized when every checkpoint tensor it is assembled from (q, k and v for the
fused qkv projection) has the same block type with a kernel (Q4_0, Q4_1, Q8_0), and this rank's
share of its input features is whole 32-value blocks; other layers (and the norms) are
dequantized at load as before. GGUF blocks are row-major, so the layers' own weight loaders
slice them for tensor parallelism and the loader's q/k row permutation moves whole rows.
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from pagellm.quantization import ggml_cpu
from pagellm.quantization.base import LinearMethod, QuantizationConfig

logger = logging.getLogger(__name__)

class GGUFLinearMethod(LinearMethod):
    """The weight as raw GGUF blocks [output_size, input_size / 32 * block bytes] (uint8)."""

    def __init__(self, qtype: int) -> None:
        self.qtype = qtype

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int) -> None:
        row_bytes = input_size // 32 * ggml_cpu.BLOCK_BYTES[self.qtype]
        layer.weight = nn.Parameter(torch.empty(output_size, row_bytes, dtype=torch.uint8), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        self.input_size, self.output_size = input_size, output_size
        self.dtype = torch.get_default_dtype()
        """The model's dtype (what an embedding lookup returns)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # Every batch size takes the kernel: each row is summed alone, in the same order, so a
        # row's result never depends on its batch.
        out = ggml_cpu.gemm(self.qtype, x.reshape(-1, self.input_size).float(), layer.weight, self.output_size)
        if bias is not None:
            out += bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.output_size)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        rows = ggml_cpu.dequantize(self.qtype, layer.weight.index_select(0, ids.reshape(-1)), self.input_size)
        return rows.to(self.dtype)


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
            qtype = self._common_type(names)
            input_size = module.input_size if isinstance(module, _ParallelLinear) else module.embedding_dim
            if qtype is None or input_size % 32:
                counts["dequantized"] += 1
                continue
            methods[id(module.weight)] = module
            module.set_quant_method(GGUFLinearMethod(qtype))
            kept.update(names)
            counts["kept quantized"] += 1
        logger.info("GGUF layers: %s", ", ".join(f"{n} {what}" for what, n in counts.items()))
        return kept

    def _common_type(self, names: list[str]) -> int | None:
        """The block type all of `names` share, if the kernels take it."""
        types = {self.qtypes.get(name) for name in names}
        qtype = types.pop() if len(types) == 1 else None
        return qtype if qtype in ggml_cpu.BLOCK_BYTES else None
