"""Per-request sampling parameters, with vLLM's names and meanings. Pure Python (no torch)."""
from __future__ import annotations

import copy
import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

_GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.IntEnum):
    """What each streamed RequestOutput holds."""

    CUMULATIVE = 0
    """Everything generated so far."""
    DELTA = 1
    """Only what is new since the previous output."""
    FINAL_ONLY = 2
    """Nothing until the request finishes, then everything."""


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's names); exactly one kind is set.

    The engine compiles it with xgrammar when the request arrives and masks every sampled token
    so that the output is always a prefix of a sentence of that language, ending when it is one.
    """

    json: str | dict | None = None
    """A JSON schema (a dict, or its JSON text): the output is a JSON value that validates."""
    regex: str | None = None
    """The output matches this regular expression."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """An EBNF (GBNF) grammar whose start rule is `root`."""
    json_object: bool | None = None
    """True: the output is any JSON object."""
    structural_tag: str | dict | None = None
    """xgrammar's structural tag (JSON): free text with constrained segments between tags."""
    disable_any_whitespace: bool = False
    """JSON without optional whitespace (compact output, fewer tokens)."""

    def __post_init__(self) -> None:
        kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, "
                             f"got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (an object or its JSON text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError("structured_outputs.structural_tag must be a JSON object or its text")

    @property
    def kind(self) -> str:
        """Which language is set: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token, when to stop, and what to return.

    `temperature=0` is greedy. Fields left at None take the model's generation-config defaults
    when the engine sees the request (see `apply_model_defaults`). Every invalid value raises a
    ValueError naming the field and its allowed range.
    """

    n: int = 1
    """Completions returned per prompt."""
    best_of: int | None = None
    """Completions generated per prompt, the n with the highest cumulative logprob returned (>= n)."""
    temperature: float | None = None
    """Softmax temperature, >= 0; 0 means greedy. None: model default, else 1.0."""
    top_p: float | None = None
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p, in (0, 1]."""
    top_k: int | None = None
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float | None = None
    """Drop tokens whose probability is below min_p times the top token's, in [0, 1]."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated, in [-2, 2]."""
    repetition_penalty: float | None = None
    """> 0; > 1 discourages tokens seen in the prompt or output (divides positive logits, multiplies negative)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    stop: list[str] | None = None
    """Strings that end generation; the matched string is left out of the text unless include_stop_str_in_output."""
    stop_token_ids: list[int] | None = None
    """Token ids that end generation (in addition to EOS unless ignore_eos)."""
    include_stop_str_in_output: bool = False
    bad_words: list[str] | None = None
    """Words (token sequences) that must never be generated."""
    ignore_eos: bool = False
    """Keep generating past the model's EOS tokens."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens, >= 1; None means up to the model's context length."""
    min_tokens: int = 0
    """EOS and stop_token_ids are suppressed until this many tokens were generated."""
    logprobs: int | None = None
    """Return this many top logprobs per generated token (plus the sampled token's own)."""
    prompt_logprobs: int | None = None
    """Return this many top logprobs per prompt token."""
    detokenize: bool = True
    """Produce output text (stop strings need it)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the output text."""
    spaces_between_special_tokens: bool = True
    """Separate special tokens from neighbouring text with a space when they are kept."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last this-many prompt tokens (>= 1)."""
    logit_bias: dict[int, float] | None = None
    """Token id -> value added to its logit, in [-100, 100]."""
    allowed_token_ids: list[int] | None = None
    """Only these token ids may be generated."""
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar (see StructuredOutputsParams)."""
    extra_args: dict[str, Any] | None = None
    """Arguments for the engine's extensions, as vLLM's: "kv_transfer_params" (a dict) drives the KV
    connector's prefill/decode transfer (docs/disaggregated.md)."""
    _bad_words_token_ids: list[list[int]] | None = None
    """Set by the engine's input processor from bad_words (with and without a leading space), not by users."""

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else (self.stop if self.stop is not None else [])
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.bad_words is None:
            self.bad_words = []
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}")
            self.logit_bias = {_token_key(k): v for k, v in self.logit_bias.items()}
        self._validate()

    def _validate(self) -> None:
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a mapping, got {self.extra_args!r}")
        transfer = (self.extra_args or {}).get("kv_transfer_params")
        if transfer is not None and not isinstance(transfer, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {transfer!r}")
        if _not_int(self.n) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.best_of is not None and (_not_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        _check_range("temperature", self.temperature, 0.0, None)
        if self.top_p is not None and (_not_real(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (_not_int(self.top_k) or self.top_k < -1):
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {self.top_k!r}")
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.repetition_penalty is not None and (_not_real(self.repetition_penalty) or self.repetition_penalty <= 0):
            raise ValueError(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if self.seed is not None and _not_int(self.seed):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of non-blank strings, got {self.bad_words!r}")
        if self.max_tokens is not None and (_not_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if _not_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (_not_int(value) or value < 0):
                raise ValueError(f"{name} must be a non-negative integer or None, got {value!r}")
        if self.truncate_prompt_tokens is not None and (
                _not_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < 1):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer, got {self.truncate_prompt_tokens!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if _not_real(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token_id}")
        if self.allowed_token_ids is not None:
            _check_token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        if self.structured_outputs is not None and self.min_tokens > 0:
            # min_tokens bans the end of output, which a complete sentence of the grammar needs.
            raise ValueError("min_tokens cannot be combined with structured_outputs: the grammar decides where "
                             "the output ends")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    def apply_model_defaults(self, generation_config: dict) -> "SamplingParams":
        """A copy with unset fields filled from the model's generation_config.json."""
        def pick(value, key, fallback):
            if value is not None:
                return value
            default = generation_config.get(key)
            return default if default is not None else fallback

        # A deep copy first: the result must not share lists with the caller's params.
        return dataclasses.replace(
            copy.deepcopy(self),
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
        )

    @property
    def is_greedy(self) -> bool:
        return self.temperature is not None and self.temperature < _GREEDY_EPS

    @property
    def reads_output_history(self) -> bool:
        """Whether sampling reads the tokens generated so far (penalties, bad words, min_tokens, a
        grammar). The engine steps such requests without overlap, so that history is complete."""
        return bool(self._bad_words_token_ids or self.min_tokens > 0 or self.structured_outputs is not None or self.repetition_penalty not in (None, 1.0)
                    or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0)


def _token_key(key) -> int:
    """logit_bias keys arrive as strings from JSON."""
    if isinstance(key, str) and key.strip().lstrip("-").isdigit():
        return int(key)
    if _not_int(key):
        raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
    return key


def _check_token_ids(name: str, ids) -> None:
    if not isinstance(ids, (list, tuple)) or any(_not_int(t) or t < 0 for t in ids):
        raise ValueError(f"{name} must be a list of non-negative integers, got {ids!r}")


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
