"""Token embedding and output head, both split across tensor-parallel ranks by vocabulary row."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.distributed import (
    get_tp_rank,
    get_tp_world_size,
    tensor_parallel_all_gather,
    tensor_parallel_all_reduce,
)
from pagellm.models.layers.linear import copy_weight


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows are split into equal, contiguous per-rank ranges.

    The vocabulary is padded up to a multiple of the tensor-parallel size; padding rows are zero.
    `weight` may be an existing parameter to share (tied input and output embeddings).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_size = -(-num_embeddings // get_tp_world_size())
        self.shard_start = get_tp_rank() * self.shard_size
        if weight is None:
            weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
            weight.weight_loader = self.weight_loader
        elif weight.shape != (self.shard_size, embedding_dim):
            expected = (self.shard_size, embedding_dim)
            raise ValueError(f"shared weight has shape {tuple(weight.shape)}, expected {expected}")
        self.weight = weight

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} loads one unstacked tensor (got shard_id={shard_id!r})")
        if loaded_weight.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(
                f"embedding of shape {tuple(loaded_weight.shape)} does not match vocab_size={self.num_embeddings}, "
                f"hidden_size={self.embedding_dim} from the config"
            )
        rows = max(0, min(self.shard_size, self.num_embeddings - self.shard_start))
        copy_weight(param.data[:rows], loaded_weight[self.shard_start : self.shard_start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.shard_start
        elsewhere = (local_ids < 0) | (local_ids >= self.shard_size)
        out = F.embedding(local_ids.masked_fill(elsewhere, 0), self.weight)
        return tensor_parallel_all_reduce(out.masked_fill_(elsewhere.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the whole vocabulary; each rank scores its vocab rows, then gather."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab_size]."""
        logits = tensor_parallel_all_gather(F.linear(hidden, self.weight), dim=-1)
        return logits[..., : self.num_embeddings].float()
