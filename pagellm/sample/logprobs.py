"""Top-k logprobs of the model's raw distribution, for generated and prompt tokens."""
from __future__ import annotations

from collections.abc import Callable

import torch

_PROMPT_ROWS_PER_PASS = 512
"""Prompt positions turned into logits at once: bounds the [rows, vocab] temporaries of a long chunk."""


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logprobs [N, vocab] float32, token_ids [N] int64 (the token at each position), k >= 0 ->
    (ids [N, k + 1] int64, values [N, k + 1] float32, ranks [N] int64). Column 0 is the given token,
    the other columns the top k; a rank is 1 + the number of strictly more likely tokens."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_values, top_ids = logprobs.topk(k, dim=1)
    return torch.cat([token_ids.unsqueeze(1), top_ids], dim=1), torch.cat([chosen, top_values], dim=1), ranks


def prompt_logprobs(hidden: torch.Tensor, targets: torch.Tensor, k: int,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, hidden_size] of prompt positions, targets [N] the prompt token that follows each:
    `gather_logprobs` of their raw distributions, a bounded number of rows at a time."""
    parts = []
    for start in range(0, hidden.shape[0], _PROMPT_ROWS_PER_PASS):
        end = start + _PROMPT_ROWS_PER_PASS
        logprobs = compute_logits(hidden[start:end]).float().log_softmax(dim=-1)
        parts.append(gather_logprobs(logprobs, targets[start:end], k))
    return tuple(torch.cat(columns) for columns in zip(*parts))
