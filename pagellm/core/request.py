"""One request: the record of what was asked (`EngineCoreRequest`), and the scheduler's state of it."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import msgspec

from pagellm.core.hashing import BlockHash, extend_block_hashes
from pagellm.core.interfaces import Grammar
from pagellm.lora_request import LoRARequest
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """At least one token must be generated within max_model_len."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}: "
            "shorten it or raise max_model_len (at least one token must be generated)")


class EngineCoreRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Everything one request asked for, as the input processor resolved it: the one declaration of
    a request's fields.

    Made once by the input processor (`engine/processor.py`), it travels to the engine core as it
    is (over the ZMQ wire, `engine/wire.py`; pickled to worker processes inside `NewRequestData`)
    and is held, never copied field by field, by what the scheduler (`Request`), the workers
    (`CachedRequestState`) and the output processor (`_RequestState`) keep of the request. A new
    per-request field is declared here and read where it is used. n > 1 children are copies with
    their own id and sampling params (`msgspec.structs.replace`).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    """Resolved: the model's generation-config defaults applied and bad words tokenized
    (`_bad_words_token_ids`). A pooling request's are inert defaults (it samples nothing)."""
    eos_token_ids: frozenset[int]
    """The model's EOS ids: generation stops at one (unless ignore_eos), and the worker masks them
    until min_tokens are generated."""
    max_tokens: int
    """Generation cap after clamping to the model's context length (0 for a pooling request)."""
    arrival_time: float = msgspec.field(default_factory=time.monotonic)
    """time.monotonic() when the request arrived (the same clock in every process of one machine)."""
    pooling_params: PoolingParams | None = None
    """Set for a pooling-runner request (embeddings): it runs its prompt once and samples nothing."""
    cache_salt: str | None = None
    """Isolates its prefix-cache entries: its blocks' hashes chain the salt in, so only requests
    with the same salt share them (vLLM's `cache_salt`)."""
    lora_request: LoRARequest | None = None
    """The adapter it runs with (None: the base model). Its blocks' hashes chain the adapter's id
    in: KV computed under one adapter is never reused under another."""
    priority: int = 0
    """Under the priority scheduling policy (`--scheduling-policy priority`), requests with a lower
    value are admitted first and preempted last; arrival_time breaks ties. 0 under fcfs."""


class RecordFields:
    """The record's fields, read through `record`, for whatever holds one (the scheduler's, the
    workers' and the output processor's state of a request): no holder declares them again."""

    __slots__ = ()
    record: EngineCoreRequest

    @property
    def request_id(self) -> str:
        return self.record.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.record.prompt_token_ids

    @property
    def sampling_params(self) -> SamplingParams:
        return self.record.sampling_params

    @property
    def pooling_params(self) -> PoolingParams | None:
        return self.record.pooling_params

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.record.eos_token_ids

    @property
    def max_tokens(self) -> int:
        return self.record.max_tokens

    @property
    def arrival_time(self) -> float:
        return self.record.arrival_time

    @property
    def kv_transfer_params(self) -> dict | None:
        """The prefill/decode transfer it asks for (`SamplingParams.extra_args`), if any."""
        extra = self.record.sampling_params.extra_args
        return None if extra is None else extra.get("kv_transfer_params")

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        lora = self.record.lora_request
        return 0 if lora is None else lora.lora_int_id


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    """Holding its blocks while a KV connector loads its prompt's KV from a remote engine."""
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """OpenAI/vLLM finish_reason: stop, length or abort."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False, kw_only=True)
class Request(RecordFields):
    """The scheduler's state of one request: tokens so far, how many of them have KV in the cache,
    and why it stopped. What was asked is its `record`, read through the properties below."""

    record: EngineCoreRequest
    all_token_ids: list[int] = field(init=False)
    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_cached_tokens: int = -1
    """Prompt tokens served from the prefix cache at first scheduling (-1: not scheduled yet)."""
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    num_output_placeholders: int = 0
    """Tokens sampled by a step still in flight: scheduled as input before their ids are known.
    For a pooling request: 1 while the step that pools its last prompt chunk is in flight."""
    grammar: Grammar | None = None
    """The matcher of a request with structured output, set by the scheduler when it arrives."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens scheduled after its last token by the step in flight (speculative decoding)."""
    proposed_token_ids: list[int] = field(default_factory=list)
    """The draft model's proposal for its next step (draft_model speculation), until scheduled."""
    kv_quiet_until: int = 0
    """Up to this many tokens, the blocks it holds have room, no block fills and no sliding window
    has more than a decode's blocks to give back: allocating them changes nothing (kept by
    `KVCacheManager`), so a decode step need not call it."""
    num_swapped_tokens: int = 0
    """Tokens whose KV a swap preemption saved to the host tier, until it resumes (KV connector)."""
    load_failed: bool = False
    """A KV connector's load into its blocks failed: it recomputes, and loads nothing more."""
    worker_out_of_date: bool = False
    """Its computed tokens moved other than by the tokens scheduled (rejected drafts rolled back):
    the next step tells the workers where it stands."""

    _stop_ids: frozenset[int] = field(init=False)
    """The tokens that may end it: EOS (unless ignore_eos) and stop_token_ids (see `check_stop`)."""

    @classmethod
    def from_record(cls, record: EngineCoreRequest) -> Request:
        """A request that has just arrived (waiting, nothing computed)."""
        return cls(record=record)

    def __post_init__(self) -> None:
        record = self.record
        self.all_token_ids = list(record.prompt_token_ids)
        self.num_prompt_tokens = len(record.prompt_token_ids)
        sp = record.sampling_params
        self._stop_ids = frozenset(sp.stop_token_ids or ()) | frozenset(() if sp.ignore_eos else record.eos_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    def reaches_limit_in_flight(self, max_model_len: int) -> bool:
        """Whether the tokens in flight already take it to max_tokens or max_model_len, so it ends
        when they arrive and must not be scheduled further."""
        return self.num_output_placeholders > 0 and (
            self.num_output_tokens + self.num_output_placeholders >= self.record.max_tokens
            or self.num_tokens_with_placeholders >= max_model_len)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def skips_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, which cached tokens never produce."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def extra_keys(self) -> tuple:
        """What its blocks' hashes chain in besides the tokens: the adapter and the cache salt, if any."""
        record = self.record
        keys = () if record.lora_request is None else (("lora", record.lora_request.lora_int_id),)
        return keys if record.cache_salt is None else (*keys, record.cache_salt)

    def update_block_hashes(self, block_size: int) -> None:
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size, self.extra_keys)

    def check_stop(self, token_id: int, max_model_len: int) -> bool:
        """After appending `token_id`: set a finished status if generation must end."""
        record = self.record
        num_output = len(self.all_token_ids) - self.num_prompt_tokens
        # The sampler masks EOS and stop tokens below min_tokens; this keeps the rule even for
        # a token that reached here some other way.
        if token_id in self._stop_ids and num_output >= record.sampling_params.min_tokens:
            self.status = RequestStatus.FINISHED_STOPPED
            if record.sampling_params.ignore_eos or token_id not in record.eos_token_ids:
                self.stop_reason = token_id
        elif num_output >= record.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return self.status.is_finished
