"""Greedy and random sampling with temperature, top-k, top-p and min-p, in one pass over the batch."""
from __future__ import annotations

import torch

from pagellm import ops
from pagellm.sample.metadata import SamplingMetadata
from pagellm.structured_output.bitmask import apply_token_bitmask


def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """logits [num_rows, vocab] -> token ids [num_rows] int64."""
    logits = in_float32(logits, md)
    if md.processors is not None:
        logits = md.processors.apply(logits)
    if md.grammar_rows is not None:
        logits = apply_token_bitmask(logits, md.grammar_rows, md.grammar_bitmask)
    greedy = ops.argmax(logits)
    if md.all_greedy:
        return greedy
    logits = logits / md.temperature.unsqueeze(1)
    logits = apply_filters(logits, md)
    probs = logits.softmax(dim=-1)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, with no host sync and with
    # per-row noise that seeded rows take from their own generator.
    noise = torch.empty_like(probs).exponential_(generator=md.default_generator)
    for row, gen in md.generators.items():
        noise[row].exponential_(generator=gen)
    drawn = ops.argmax(probs / noise)
    return torch.where(md.is_greedy, greedy, drawn)


def in_float32(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits as sampling computes with them: float32, except for a batch that only takes
    each row's argmax (the same in the model's dtype, without a float32 copy of every row)."""
    if md.all_greedy and md.processors is None and md.grammar_rows is None:
        return logits
    return logits.float()


def apply_filters(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Top-k, then top-p, then min-p (Hugging Face's order); filtered logits become -inf."""
    if md.top_k is not None or md.top_p is not None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if md.top_k is not None:
            ranks = torch.arange(logits.shape[-1], device=logits.device)
            drop |= ranks.unsqueeze(0) >= md.top_k.unsqueeze(1)
        if md.top_p is not None:
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Mass strictly before each token: a token is kept while that mass is below top_p,
            # so the most likely token always stays.
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before >= md.top_p.unsqueeze(1)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if md.min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * md.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
