"""Per-request edits of the logits before sampling, each one batched pass over the rows that use it.

In vLLM's order: allowed_token_ids, bad_words, min_tokens, logit_bias, then the repetition,
frequency and presence penalties. A step where no row uses a feature builds nothing for it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagellm.sampling_params import SamplingParams


def uses_logits_processors(p: SamplingParams) -> bool:
    return bool(p.allowed_token_ids is not None or p._bad_words_token_ids or p.min_tokens > 0 or p.logit_bias
                or _uses_penalties(p))


def _uses_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty not in (None, 1.0) or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


@dataclass(slots=True)
class LogitsProcessors:
    """What one step's rows need beyond temperature and the top-k/top-p/min-p filters."""

    disallowed: torch.Tensor | None
    """[num_rows, vocab] bool: True outside a row's allowed_token_ids (all False for rows without)."""
    banned: tuple[torch.Tensor, torch.Tensor] | None
    """(rows, token ids) set to -inf: the last token of a bad word whose prefix was just generated,
    and EOS / stop_token_ids of rows still short of min_tokens."""
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    """(rows, token ids, values) added to the logits."""
    history: torch.Tensor | None
    """[num_rows, max_len] int64: prompt + output ids of penalized rows, padded with vocab_size
    (rows without penalties are all padding)."""
    num_prompt_tokens: torch.Tensor | None
    """[num_rows] int64: where each row's output starts in `history`."""
    repetition: torch.Tensor | None
    """[num_rows] float32, 1.0 for rows without; None when no row uses it."""
    frequency: torch.Tensor | None
    """[num_rows] float32, 0.0 for rows without; None when no row uses frequency or presence."""
    presence: torch.Tensor | None
    """[num_rows] float32, like `frequency`."""

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        token_ids: Sequence[Sequence[int]],
        num_prompt_tokens: Sequence[int],
        eos_token_ids: Sequence[Sequence[int]],
        vocab_size: int,
        device: torch.device,
    ) -> "LogitsProcessors | None":
        """Row i: its params, its prompt + output ids so far, its prompt length and the model's EOS
        ids. None when no row uses any of these features."""
        rows = [i for i, p in enumerate(params) if uses_logits_processors(p)]
        if not rows:
            return None
        num_rows = len(params)
        allowed_rows, allowed_ids = [], []
        ban_rows, ban_ids = [], []
        bias_rows, bias_ids, bias_values = [], [], []
        penalized = []
        for i in rows:
            p, tokens = params[i], token_ids[i]
            num_output = len(tokens) - num_prompt_tokens[i]
            if p.allowed_token_ids is not None:
                allowed_rows += [i] * len(p.allowed_token_ids)
                allowed_ids += p.allowed_token_ids
            for word in p._bad_words_token_ids or ():
                # A bad word's last token is banned once the output ends with the rest of it.
                prefix_len = len(word) - 1
                if prefix_len <= num_output and list(tokens[len(tokens) - prefix_len:]) == word[:-1]:
                    ban_rows.append(i)
                    ban_ids.append(word[-1])
            if num_output < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids[i]))
                ban_rows += [i] * len(stops)
                ban_ids += stops
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
            if _uses_penalties(p):
                penalized.append(i)

        def ints(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        disallowed = None
        if allowed_rows:
            restricted = ints(sorted(set(allowed_rows)))
            allowed = torch.ones(num_rows, vocab_size, dtype=torch.bool, device=device)
            allowed[restricted] = False
            allowed[ints(allowed_rows), ints(allowed_ids)] = True
            disallowed = ~allowed
        out = cls(
            disallowed=disallowed,
            banned=(ints(ban_rows), ints(ban_ids)) if ban_rows else None,
            bias=(ints(bias_rows), ints(bias_ids), torch.tensor(bias_values, dtype=torch.float32).to(device, non_blocking=True))
            if bias_rows else None,
            history=None, num_prompt_tokens=None, repetition=None, frequency=None, presence=None,
        )
        if penalized:
            out._set_penalties([params[i] for i in penalized], penalized, token_ids, num_prompt_tokens,
                               num_rows, vocab_size, device)
        return out

    def _set_penalties(self, params: list[SamplingParams], rows: list[int], token_ids: Sequence[Sequence[int]],
                       num_prompt_tokens: Sequence[int], num_rows: int, vocab_size: int,
                       device: torch.device) -> None:
        # Rebuilt each step from the worker's token lists: correct and batched; an incremental
        # per-request count table would save the host work on long histories.
        max_len = max(len(token_ids[i]) for i in rows)
        history = np.full((num_rows, max_len), vocab_size, dtype=np.int64)
        for i in rows:
            history[i, :len(token_ids[i])] = token_ids[i]
        self.history = torch.from_numpy(history).to(device, non_blocking=True)
        self.num_prompt_tokens = torch.tensor(num_prompt_tokens, dtype=torch.int64).to(device, non_blocking=True)

        def per_row(name: str, neutral: float) -> torch.Tensor:
            values = [neutral] * num_rows
            for i, p in zip(rows, params):
                values[i] = getattr(p, name)
            return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

        if any(p.repetition_penalty not in (None, 1.0) for p in params):
            self.repetition = per_row("repetition_penalty", 1.0)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            self.frequency = per_row("frequency_penalty", 0.0)
            self.presence = per_row("presence_penalty", 0.0)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [num_rows, vocab] float32 -> a new tensor with every feature applied."""
        if self.disallowed is not None:
            logits = logits.masked_fill(self.disallowed, float("-inf"))
        if self.banned is not None:
            logits = logits.index_put(self.banned, torch.tensor(float("-inf"), device=logits.device))
        if self.bias is not None:
            rows, ids, values = self.bias
            logits = logits.index_put((rows, ids), values, accumulate=True)
        if self.history is not None:
            logits = self._apply_penalties(logits)
        return logits

    def _apply_penalties(self, logits: torch.Tensor) -> torch.Tensor:
        num_rows, vocab = logits.shape
        if self.repetition is not None:
            # Hugging Face's rule over prompt and output: shrink a seen token's logit towards 0
            # when positive, push it further down when negative. The padding id lands in the
            # extra last column, which is dropped.
            seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
            seen = seen.scatter_(1, self.history, True)[:, :vocab]
            penalty = self.repetition.unsqueeze(1)
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if self.frequency is not None:
            # OpenAI's rule over the output only: minus frequency per occurrence, minus presence once.
            positions = torch.arange(self.history.shape[1], device=logits.device)
            is_output = (positions.unsqueeze(0) >= self.num_prompt_tokens.unsqueeze(1)).to(logits.dtype)
            counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
            counts = counts.scatter_add_(1, self.history, is_output)[:, :vocab]
            logits = (logits - self.frequency.unsqueeze(1) * counts
                      - self.presence.unsqueeze(1) * (counts > 0).to(logits.dtype))
        return logits
