"""Per-row sampling settings of one step, as device tensors."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.sample.logits_processors import LogitsProcessors
from pagellm.sampling_params import SamplingParams

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, step) pairs apart


@dataclass(slots=True)
class SamplingMetadata:
    """What the sampler needs for `num_rows` rows of logits."""

    temperature: torch.Tensor | None
    """[num_rows] float32; greedy rows hold 1.0 (they take the argmax anyway). None when all are."""
    is_greedy: torch.Tensor | None
    """[num_rows] bool; None when all rows are greedy."""
    all_greedy: bool
    top_k: torch.Tensor | None
    """[num_rows] int64, vocab_size where disabled; None when no row uses it."""
    top_p: torch.Tensor | None
    """[num_rows] float32; None when no row uses it."""
    min_p: torch.Tensor | None
    """[num_rows] float32; None when no row uses it."""
    generators: dict[int, torch.Generator]
    """Row -> generator for rows with their own seed."""
    default_generator: torch.Generator | None
    """Draws for unseeded rows: the engine's, seeded by `LLM(seed=...)`, so runs repeat."""
    processors: LogitsProcessors | None = None
    """Penalties, biases and bans, applied before everything else (greedy rows included)."""
    grammar_rows: torch.Tensor | None = None
    """[num_grammar_rows] int64: rows under a grammar this step (structured output)."""
    grammar_bitmask: torch.Tensor | None = None
    """int32 [num_grammar_rows, ceil(vocab / 32)]: their allowed tokens, packed (see apply_token_bitmask)."""

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        num_generated: list[int],
        vocab_size: int,
        device: torch.device,
        default_generator: torch.Generator | None = None,
        processors: LogitsProcessors | None = None,
    ) -> "SamplingMetadata":
        """`num_generated[i]`: tokens row i has generated so far, which keys its seeded draw."""
        greedy = [p.is_greedy for p in params]
        all_greedy = all(greedy)
        if all_greedy:  # the argmax alone: nothing to send to the device
            return cls(None, None, True, None, None, None, {}, default_generator, processors)
        temperature = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [p.top_k if p.top_k and p.top_k > 0 else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        generators = {}
        for row, (p, g, n) in enumerate(zip(params, greedy, num_generated)):
            if p.seed is not None and not g:
                # Keyed by (seed, step), not a running generator state: the same seed gives
                # the same tokens after a preemption and whatever else shares the batch.
                gen = torch.Generator(device=device)
                gen.manual_seed((p.seed * _SEED_STRIDE + n) % (1 << 63))
                generators[row] = gen

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        return cls(
            temperature=tensor(temperature, torch.float32),
            is_greedy=tensor(greedy, torch.bool),
            all_greedy=False,
            top_k=None if all(k >= vocab_size for k in top_k) else tensor(top_k, torch.int64),
            top_p=None if all(p >= 1.0 for p in top_p) else tensor(top_p, torch.float32),
            min_p=None if all(p <= 0.0 for p in min_p) else tensor(min_p, torch.float32),
            generators=generators,
            default_generator=default_generator,
            processors=processors,
        )
