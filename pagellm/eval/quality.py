"""What a quantized model gives up: perplexity on a text, and how far its next-token distributions
move from a reference model's (top-1 agreement, KL divergence), on the same tokens.

The text is cut into windows of `context` tokens; each window is one prompt run from position 0,
every model sees the same windows, and each of a window's tokens but the first is predicted from
the ones before it. A model with a KV cache bound (`bind_window_cache`: to measure a float8 cache)
writes each window into it and attends over what it stored; others attend within the window.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagellm.core.kv_cache_groups import kv_cache_groups
from pagellm.models import CausalLM
from pagellm.worker.loading import bind_kv_cache, prompt_hidden_states

_LOGIT_ROWS = 256
"""Rows of logits computed at once (a window's full-vocabulary float32 logits can be large)."""
_BLOCK_SIZE = 16


@dataclass(slots=True)
class QualityResult:
    """One model's figures over every predicted token of the text."""

    tokens: int = 0
    nll_sum: float = 0.0
    """Sum of -log p(actual next token)."""
    kl_sum: float = 0.0
    """Sum of KL(reference || this model) over the predicted positions."""
    top1_agree: int = 0
    """Positions where this model's most likely token is the reference's."""
    kl_per_window: list[float] = field(default_factory=list)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / max(self.tokens, 1))

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / max(self.tokens, 1)

    @property
    def top1_agreement(self) -> float:
        return self.top1_agree / max(self.tokens, 1)


def windows(token_ids: list[int], context: int) -> list[list[int]]:
    """Consecutive windows of at most `context` tokens (a last one shorter than 2 is dropped: it
    predicts nothing)."""
    parts = [token_ids[i:i + context] for i in range(0, len(token_ids), context)]
    return [p for p in parts if len(p) >= 2]


def bind_window_cache(model: CausalLM, context: int, dtype: torch.dtype, device: torch.device) -> None:
    """Give `model` a KV cache of `dtype` that holds one window, which `log_probs` then goes through."""
    groups = kv_cache_groups(model.config.sliding_windows)
    bind_kv_cache(model, groups, len(groups) * -(-context // _BLOCK_SIZE), _BLOCK_SIZE, dtype, device)


@torch.inference_mode()
def log_probs(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """float32 log-softmax of `model`'s next-token logits at every position of `ids` but the last
    ([len(ids) - 1, vocab]): one prompt from position 0, through the model's KV cache if one is
    bound (`bind_window_cache`)."""
    n = len(ids)
    hidden = prompt_hidden_states(model, ids)[: n - 1]
    return torch.cat([torch.log_softmax(model.compute_logits(hidden[i:i + _LOGIT_ROWS]).float(), dim=-1)
                      for i in range(0, n - 1, _LOGIT_ROWS)])


def evaluate(models: dict[str, CausalLM], reference: str, token_ids: list[int], context: int,
             device: torch.device, progress: Callable[[int], None] | None = None) -> dict[str, QualityResult]:
    """Each model's `QualityResult` on `token_ids`, distributions compared with `models[reference]`.
    `progress(n)` is called after each window with its number of predicted tokens."""
    results = {name: QualityResult() for name in models}
    for window in windows(token_ids, context):
        targets = torch.tensor(window[1:], device=device)
        ref = log_probs(models[reference], window)
        ref_top1 = ref.argmax(dim=-1)
        for name, model in models.items():
            lp = ref if name == reference else log_probs(model, window)
            r = results[name]
            r.tokens += len(targets)
            r.nll_sum -= lp.gather(1, targets[:, None]).sum().item()
            kl = (ref.exp() * (ref - lp)).sum().item()  # KL(ref || model), summed over positions
            r.kl_sum += kl
            r.kl_per_window.append(kl / len(targets))
            r.top1_agree += int((lp.argmax(dim=-1) == ref_top1).sum())
        if progress is not None:
            progress(len(targets))
    return results
