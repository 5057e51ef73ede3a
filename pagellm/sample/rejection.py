"""Verification of draft tokens (speculative decoding), batched on the device.

Each row scores one position of a request: rows with a draft decide whether the model takes it,
a request's last row samples the token after its drafts. The proposals are single tokens (a
point mass q), so Leviathan et al.'s rule reduces to: accept draft d with probability p(d), and at
the first rejection draw from p without d, renormalised. Every emitted token then has exactly the
target distribution p; greedy rows accept d exactly when it is the argmax, so greedy output is
the same as without speculation.
"""
from __future__ import annotations

import torch

from pagellm import ops
from pagellm.sample.metadata import SamplingMetadata
from pagellm.sample.sampler import apply_filters, in_float32
from pagellm.structured_output.bitmask import apply_token_bitmask


def verify(logits: torch.Tensor, md: SamplingMetadata, draft_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab]; draft_ids [rows] int64 (-1: no draft, the row samples freely).

    Returns (tokens, accepted), both [rows]: `accepted[r]` whether row r's draft is taken (then
    tokens[r] is the draft); a request keeps its rows up to the first one not accepted, whose
    token (the replacement, or the last row's free sample) ends its output for the step."""
    logits = in_float32(logits, md)
    if md.processors is not None:
        logits = md.processors.apply(logits)
    if md.grammar_rows is not None:
        logits = apply_token_bitmask(logits, md.grammar_rows, md.grammar_bitmask)
    has_draft = draft_ids >= 0
    greedy = ops.argmax(logits)
    greedy_accepts = has_draft & (greedy == draft_ids)
    if md.all_greedy:
        return greedy, greedy_accepts
    probs = apply_filters(logits / md.temperature.unsqueeze(1), md).softmax(dim=-1)
    draft = draft_ids.clamp(min=0).unsqueeze(1)
    # Seeded rows draw from their own generator: first the acceptance test, then the noise.
    uniform = torch.rand(len(probs), device=probs.device, generator=md.default_generator)
    noise = torch.empty_like(probs).exponential_(generator=md.default_generator)
    for row, gen in md.generators.items():
        uniform[row] = torch.rand(1, device=probs.device, generator=gen)[0]
        noise[row].exponential_(generator=gen)
    accepts = has_draft & (uniform < probs.gather(1, draft).squeeze(1))
    # A rejected draft is replaced by a draw from p without it (exponential race, as `sample`).
    residual = torch.where(has_draft.unsqueeze(1), probs.scatter(1, draft, 0.0), probs)
    drawn = ops.argmax(residual / noise)
    accepted = torch.where(md.is_greedy, greedy_accepts, accepts)
    tokens = torch.where(md.is_greedy, greedy, drawn)
    return torch.where(accepted, draft_ids, tokens), accepted
