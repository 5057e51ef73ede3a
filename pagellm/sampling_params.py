"""Per-request sampling parameters, with vLLM's names and meanings. Pure Python (no torch)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature=0` is greedy. Fields left at None take the model's generation-config defaults
    when the engine sees the request (see `apply_model_defaults`).
    """

    n: int = 1
    """Number of completions per prompt (only 1 until parallel sampling lands)."""
    temperature: float | None = None
    """Softmax temperature; 0 means greedy. None: model default, else 1.0."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    top_k: int | None = None
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float | None = None
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None means up to the model's context length."""
    stop_token_ids: list[int] | None = field(default_factory=list)
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""

    def __post_init__(self) -> None:
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._validate()

    def _validate(self) -> None:
        if _not_int(self.n) or self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported yet), got {self.n!r}")
        _check_range("temperature", self.temperature, 0.0, None)
        if self.top_p is not None and (_not_real(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (_not_int(self.top_k) or self.top_k < -1):
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        if self.max_tokens is not None and (_not_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if self.seed is not None and _not_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or any(
                _not_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")

    def apply_model_defaults(self, generation_config: dict) -> "SamplingParams":
        """A copy with unset fields filled from the model's generation_config.json."""
        def pick(value, key, fallback):
            if value is not None:
                return value
            default = generation_config.get(key)
            return default if default is not None else fallback

        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            seed=self.seed,
            max_tokens=self.max_tokens,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature is not None and self.temperature < _GREEDY_EPS


def _not_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int)


def _not_real(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)


def _check_range(name: str, value, low: float, high: float | None) -> None:
    if value is None:
        return
    if _not_real(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be a number {bound}, got {value!r}")
