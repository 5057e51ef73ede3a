"""Tensor-parallel-aware building blocks shared by the model definitions."""
from pagellm.layers.activation import GeluTanhAndMul, SiluAndMul
from pagellm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.layers.layernorm import RMSNorm
from pagellm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from pagellm.layers.rotary import RotaryEmbedding

__all__ = [
    "ColumnParallelLinear",
    "GeluTanhAndMul",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "VocabParallelEmbedding",
    "default_weight_loader",
]
