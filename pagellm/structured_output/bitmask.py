"""Applying a grammar's packed token bitmask to logits, on the logits' device."""
from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [num_rows, vocab] with the tokens each of `rows` may not sample at -inf.

    `bitmask` int32 [len(rows), ceil(vocab / 32)]: bit j of word w allows token 32 * w + j
    (xgrammar's layout). Unpacked with shifts rather than a custom kernel: a few element-wise ops
    over rows x vocab, small next to the logits' own computation."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    masked = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_put((rows,), masked)
