"""Tensor-parallel-aware building blocks shared by the model definitions."""
from pagellm.models.layers.activation import SiluAndMul
from pagellm.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.models.layers.layernorm import RMSNorm
from pagellm.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagellm.models.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
]
