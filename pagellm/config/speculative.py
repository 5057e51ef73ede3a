"""`speculative_config` as vLLM takes it: a dict in `LLM(...)`, JSON with `--speculative-config`;
and the proposers its `method` names (`PROPOSER_REGISTRY`; the interface and `register_proposer`
are in `pagellm.spec_decode`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pagellm.config.json_flags import json_object
from pagellm.config.registry import Registry

_FLAG = "speculative_config (--speculative-config)"
_NGRAM_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
_MODEL_KEYS = ("model", "quantization")
_SUFFIX_KEYS = ("suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
                "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")
METHOD_KEYS = (*_NGRAM_KEYS, *_MODEL_KEYS, *_SUFFIX_KEYS)
"""The keys that apply to some methods only (a proposer's entry says which are its own)."""
_KEYS = ("method", "num_speculative_tokens", "disable_by_batch_size", *METHOD_KEYS)
MAX_SPECULATIVE_TOKENS = 16

ProposerPlace = Literal["scheduler", "worker"]
"""Where a proposer runs: beside the scheduler in the engine core, on the host, proposing from
token ids (n-gram); or in each worker, on the device, after the step that sampled (a draft model)."""


@dataclass(frozen=True, slots=True)
class ProposerEntry:
    """A speculative decoding method (`speculative_config`'s `method`) and its proposer."""

    name: str
    cls: Any
    """A `pagellm.spec_decode.HostProposer` or `DeviceProposer` subclass, or its
    "package.module:Class" name, imported where it runs."""
    runs_in: ProposerPlace
    """Which process builds it: the engine core's scheduler or the workers."""
    keys: tuple[str, ...] = ()
    """Which of `METHOD_KEYS` it takes; with "model" the config must name a draft model."""
    aliases: tuple[str, ...] = ()
    """Other names `method` may give it (vLLM's older ones)."""
    description: str = ""


PROPOSER_REGISTRY: Registry[ProposerEntry] = Registry("speculative decoding method", f"{_FLAG} method", builtins=(
    ProposerEntry("ngram", "pagellm.spec_decode.ngram:NgramProposer", "scheduler", _NGRAM_KEYS, ("[ngram]",),
                  "prompt lookup"),
    ProposerEntry("draft_model", "pagellm.worker.draft_model:DraftModelProposer", "worker", _MODEL_KEYS, ("draft",),
                  "a smaller model of the same vocabulary"),
    ProposerEntry("suffix", "pagellm.spec_decode.suffix:SuffixProposer", "scheduler", _SUFFIX_KEYS, (),
                  "suffix tries over the request and recent outputs"),
))
"""Every `speculative_config` method, by name."""


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """Where the draft tokens come from (`method`, a `PROPOSER_REGISTRY` name): prompt lookup
    ("ngram": the tokens that followed the latest earlier occurrence of the request's last n tokens,
    n from `prompt_lookup_max` down to `prompt_lookup_min`), a smaller model of the same
    vocabulary ("draft_model": `model`, decoding greedily with its own KV cache), or suffix decoding
    ("suffix": the most frequent continuation of the request's latest tokens in its own tokens and
    in recent requests' outputs, `suffix_decoding_*`)."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    """Single-token matches are mostly chance: on SmolLM2 they made a code-editing task 0.73x as
    fast (acceptance 5%, benchmarks/results/spec_decode_cpu_20261201T224339Z.json), where a
    minimum of 2 kept it near 1x and sped the other tasks up as much."""
    prompt_lookup_max: int = 4
    disable_by_batch_size: int | None = None
    """No proposals while this many requests or more run: big batches are bound by compute, where
    verifying rejected tokens costs more than it saves."""
    method: str = "ngram"
    """The proposer: a `PROPOSER_REGISTRY` name."""
    model: str | None = None
    """The draft model (draft_model): a GGUF file or Hugging Face directory, as the target's."""
    quantization: str | None = None
    """The draft's weights (draft_model), as the target's --quantization; None: its default."""
    suffix_decoding_max_tree_depth: int = 24
    """(suffix) The longest substring the suffix tries index: a match and its continuation
    together. vLLM's default."""
    suffix_decoding_max_cached_requests: int = 1000
    """(suffix) How many finished requests' outputs the global trie keeps (first in, first out; 0:
    none). vLLM's default is 10,000; the tries here are Python objects of up to max_tree_depth
    nodes of 64 bytes per output token (1.5 KB a token of text that does not repeat), so the
    default is a tenth of that."""
    suffix_decoding_max_spec_factor: float = 1.0
    """(suffix) At most this many draft tokens per token of the match (a short match predicts
    little). vLLM's default."""
    suffix_decoding_min_token_prob: float = 0.1
    """(suffix) Drafts stop where the continuation's estimated probability (the product of each
    token's share of the continuations seen) falls below this. vLLM's default."""

    @classmethod
    def parse(cls, value: "str | dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """JSON text, a dict or a config -> the config (None: no speculation). Fails naming the flag."""
        if value is None or isinstance(value, cls):
            return value
        value = json_object(value, _FLAG, _KEYS)
        entry = PROPOSER_REGISTRY.get(value.get("method", "draft_model" if "model" in value else "ngram"))
        method = entry.name
        foreign = [key for key in METHOD_KEYS if key in value and key not in entry.keys]
        if foreign:
            raise ValueError(f"{_FLAG} key(s) {', '.join(foreign)} do not apply to method {method!r}")
        suffix = "suffix_decoding_max_tree_depth" in entry.keys
        if "num_speculative_tokens" not in value and not suffix:
            raise ValueError(f"{_FLAG} needs num_speculative_tokens")
        # vLLM's suffix decoding drafts up to its tree depth (24) unless told: here up to the most allowed.
        k = _integer(value, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS,
                     default=MAX_SPECULATIVE_TOKENS if suffix else None)
        disable = value.get("disable_by_batch_size")
        if disable is not None:
            disable = _integer(value, "disable_by_batch_size", 1, None)
        if "model" in entry.keys:
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f"{_FLAG} method {method!r} needs model: the draft model's path, got {model!r}")
            quantization = value.get("quantization")
            if quantization is not None and not isinstance(quantization, str):
                raise ValueError(f"{_FLAG} quantization must be a method name, got {quantization!r}")
            return cls(k, disable_by_batch_size=disable, method=method, model=model, quantization=quantization)
        if suffix:
            return cls(k, disable_by_batch_size=disable, method=method, **_suffix_settings(value))
        if "prompt_lookup_min" not in entry.keys:
            return cls(k, disable_by_batch_size=disable, method=method)
        given_high = value.get("prompt_lookup_max")
        low = _integer(value, "prompt_lookup_min", 1, None,
                       default=min(2, given_high) if isinstance(given_high, int) and given_high >= 1 else 2)
        high = _integer(value, "prompt_lookup_max", 1, None, default=max(low, 4))
        if high < low:
            raise ValueError(f"{_FLAG} prompt_lookup_max ({high}) must be >= prompt_lookup_min ({low})")
        return cls(k, low, high, disable, method=method)


def _suffix_settings(value: dict) -> dict[str, Any]:
    defaults = SpeculativeConfig.__dataclass_fields__
    settings = {key: value.get(key, defaults[key].default) for key in _SUFFIX_KEYS}
    _integer(settings, "suffix_decoding_max_tree_depth", 1, None)
    _integer(settings, "suffix_decoding_max_cached_requests", 0, None)
    for key, high in (("suffix_decoding_max_spec_factor", None), ("suffix_decoding_min_token_prob", 1.0)):
        number = settings[key]
        if (isinstance(number, bool) or not isinstance(number, (int, float)) or not number >= 0
                or (high is not None and number > high) or number == float("inf")):
            bound = f"between 0 and {high}" if high is not None else "a finite number >= 0"
            raise ValueError(f"{_FLAG} {key} must be {bound}, got {number!r}")
        settings[key] = float(number)
    return settings


def _integer(value: dict, key: str, low: int, high: int | None, default: int | None = None) -> int:
    number = value.get(key, default)
    if isinstance(number, bool) or not isinstance(number, int) or number < low or (high is not None and number > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ValueError(f"{_FLAG} {key} must be an integer {bound}, got {number!r}")
    return number
