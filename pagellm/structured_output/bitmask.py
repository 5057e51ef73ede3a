"""Applying a grammar's packed token bitmask to logits, on the logits' device."""
from __future__ import annotations

import torch


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [num_rows, vocab] with the tokens each of `rows` may not sample at -inf.

    `bitmask` int32 [len(rows), ceil(vocab / 32)]: bit j of word w allows token 32 * w + j. xgrammar's
    kernels do the masking (C++ on the CPU, Triton/CUDA on the GPU): several times faster than
    unpacking the bits with tensor ops. They index logits and bitmask rows alike, so the grammar rows
    are masked as one compact block and written back."""
    import xgrammar as xgr

    block = logits[rows]
    xgr.apply_token_bitmask_inplace(block, bitmask)
    return logits.index_put((rows,), block)
