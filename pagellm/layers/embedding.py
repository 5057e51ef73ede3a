"""Token embedding and output head, both split across tensor-parallel ranks by vocabulary row."""
from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed import get_tp_rank, get_tp_world_size, tensor_parallel_all_gather, tensor_parallel_all_reduce
from pagellm.layers.linear import copy_weight
from pagellm.layers.linear_method import LinearMethod, UnquantizedLinearMethod


class VocabParallelEmbedding(nn.Module):
    """Embedding table whose rows are split into equal, contiguous per-rank ranges.

    The vocabulary is padded up to a multiple of the tensor-parallel size; padding rows are zero.
    `weight` may be an existing parameter to share (tied input and output embeddings). The table
    is a [shard_size, embedding_dim] matrix stored by `quant_method`, like a linear layer's weight.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard_size = -(-num_embeddings // get_tp_world_size())
        self.shard_start = get_tp_rank() * self.shard_size
        if weight is None:
            self.set_quant_method(UnquantizedLinearMethod())
        else:
            if weight.shape != (self.shard_size, embedding_dim):
                expected = (self.shard_size, embedding_dim)
                raise ValueError(f"shared weight has shape {tuple(weight.shape)}, expected {expected}")
            self.quant_method: LinearMethod = UnquantizedLinearMethod()
            self.weight = weight

    def set_quant_method(self, method: LinearMethod, shared: "VocabParallelEmbedding | None" = None) -> None:
        """Store the table with `method` (before loading); `shared`: the module whose (already
        re-created) table this one shares."""
        self.quant_method = method
        if shared is None:
            method.create_weights(self, self.embedding_dim, self.shard_size)
        else:
            self.weight = shared.weight

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} loads one unstacked tensor (got shard_id={shard_id!r})")
        # A quantized table keeps the checkpoint's rows but stores each row its own way.
        if loaded_weight.shape[0] != self.num_embeddings or loaded_weight.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"embedding of shape {tuple(loaded_weight.shape)} does not match vocab_size={self.num_embeddings}, "
                f"hidden_size={self.embedding_dim} from the config"
            )
        rows = max(0, min(self.shard_size, self.num_embeddings - self.shard_start))
        copy_weight(param.data[:rows], loaded_weight[self.shard_start : self.shard_start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_world_size() == 1:
            return self.quant_method.embedding(self, input_ids)
        local_ids = input_ids - self.shard_start
        elsewhere = (local_ids < 0) | (local_ids >= self.shard_size)
        out = self.quant_method.embedding(self, local_ids.masked_fill(elsewhere, 0))
        return tensor_parallel_all_reduce(out.masked_fill_(elsewhere.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the whole vocabulary; each rank scores its vocab rows, then gather."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in the model's dtype (a greedy step's
        argmax needs no float32 copy of a batch's logits; the callers that compute with them
        convert)."""
        logits = tensor_parallel_all_gather(self.quant_method.apply(self, hidden, None), dim=-1)
        return logits[..., : self.num_embeddings]
