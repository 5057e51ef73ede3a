"""Messages between the scheduler and the workers, and from the engine core to its caller."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagellm.core.kv_connector import KVConnectorMetadata, KVConnectorOutput, KVTransferStats
from pagellm.core.request import EngineCoreRequest

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True, kw_only=True)
class NewRequestData:
    """A request the workers have not seen (or a preempted one that restarts from scratch): its
    record, and where the scheduler has it now."""

    record: EngineCoreRequest
    output_token_ids: list[int]
    """Tokens it generated before a preemption (they follow the prompt as input); empty for a
    request that is new."""
    block_ids: tuple[list[int], ...]
    """Per KV cache group, its blocks (`KVCacheManager.get_block_ids`)."""
    num_computed_tokens: int

    @property
    def req_id(self) -> str:
        return self.record.request_id


@dataclass(slots=True)
class CachedRequestData:
    """A request the workers already hold: only what changed."""

    req_id: str
    new_block_ids: tuple[list[int], ...]
    """Per KV cache group, the blocks it took this step (appended to its table)."""
    num_computed_tokens: int
    new_token_ids: list[int]
    """Output tokens the workers have not seen, from position max(num_computed_tokens, prompt
    length) on; sent only when workers do not learn sampled tokens themselves (several pipeline
    stages), else empty."""


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work, as a diff against what the workers already hold."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Tokens to compute per request, in batch order."""
    total_num_scheduled_tokens: int
    freed_req_ids: set[str]
    """Requests whose worker-side state must be dropped (finished, aborted or preempted)."""
    grammar_bitmask: "GrammarBitmask | None" = None
    """The allowed tokens of the rows that sample under a grammar this step."""
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Draft tokens per request (speculative decoding): its last scheduled tokens, after its last
    known one; each is verified against the model's own choice at the position before it."""
    propose_drafts: bool = False
    """Whether the worker's draft model proposes once this step's tokens are known (draft_model
    speculation, unless paused by disable_by_batch_size: then steps overlap instead)."""
    kv_connector_metadata: KVConnectorMetadata | None = None
    """The KV connector's transfers for this step (None: none), run before the forward."""

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class GrammarBitmask:
    """Which tokens each structured-output request may sample this step."""

    req_ids: list[str]
    bits: "np.ndarray"
    """int32 [len(req_ids), ceil(vocab / 32)]: bit j of word w allows token 32 * w + j."""


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs at a run of positions (generated or prompt tokens), as plain lists.

    Row i describes position i: column 0 is the token actually there (sampled or from the prompt),
    the remaining columns are the top-k of the model's raw distribution, best first.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    """Rank of the column-0 token: 1 + the number of tokens with a strictly higher logprob."""


@dataclass(slots=True)
class ModelRunnerOutput:
    """The tokens sampled for each request that reached the end of its known tokens this step."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    """Per request: its accepted draft tokens (speculative decoding), then the one it sampled."""
    logprobs: dict[str, TokenLogprobs] | None = None
    """Per request that asked for logprobs: one row per sampled token."""
    prompt_logprobs: dict[str, TokenLogprobs] | None = None
    """Per request whose prompt finished this step and that asked for prompt_logprobs: one row per
    prompt token after the first."""
    pooler_output: dict[str, bytes] | None = None
    """Pooling runner: per request whose prompt finished this step, its pooled vector as
    little-endian float32 bytes."""
    draft_token_ids: dict[str, list[int]] | None = None
    """draft_model speculation: per request, the draft model's proposal for its next step."""
    kv_connector_output: KVConnectorOutput | None = None
    """The KV connector's report of the step (failed loads, bytes moved), from the driver."""
    encoder_images: int = 0
    """Images the vision encoder ran on since the previous report."""
    encoder_seconds: float = 0.0
    """The time it took (measured on the device's stream, where there is one)."""


@dataclass(slots=True)
class EngineCoreOutput:
    """New tokens of one request, and its end if it ended."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    """time.monotonic() when the request was first scheduled (queue-time metric)."""
    new_logprobs: TokenLogprobs | None = None
    """One row per new token, when the request asked for logprobs."""
    new_prompt_logprobs: TokenLogprobs | None = None
    """All prompt tokens but the first, once, with the first new token (prompt_logprobs requests)."""
    pooled: bytes | None = None
    """A pooling request's vector (little-endian float32), with its finish."""
    kv_transfer_params: dict | None = None
    """With its finish, from the KV connector: what a peer needs to pull its KV (a prefill engine's)."""


def merge_step_outputs(steps: list[list[EngineCoreOutput]]) -> list[EngineCoreOutput]:
    """Several consecutive steps' outputs as one step's: per request (in order of first appearance)
    its new tokens and logprobs joined, its end taken from the last. For a reader that fell behind
    the engine: it then handles each request once for all the steps it reads."""
    if len(steps) == 1:
        return steps[0]
    parts: dict[str, list[EngineCoreOutput]] = {}
    for outputs in steps:
        for out in outputs:
            parts.setdefault(out.req_id, []).append(out)
    return [outs[0] if len(outs) == 1 else _joined(outs) for outs in parts.values()]


def _joined(outs: list[EngineCoreOutput]) -> EngineCoreOutput:
    first, last = outs[0], outs[-1]
    logprobs = [o.new_logprobs for o in outs if o.new_logprobs is not None]
    return EngineCoreOutput(
        last.req_id, [t for o in outs for t in o.new_token_ids], last.finish_reason, last.stop_reason,
        last.num_cached_tokens, first.first_scheduled_time,
        TokenLogprobs([r for lp in logprobs for r in lp.token_ids], [r for lp in logprobs for r in lp.logprobs],
                      [r for lp in logprobs for r in lp.ranks]) if logprobs else None,
        next((o.new_prompt_logprobs for o in outs if o.new_prompt_logprobs is not None), None),
        next((o.pooled for o in reversed(outs) if o.pooled is not None), None))


@dataclass(slots=True)
class SchedulerStats:
    """Counters the metrics and the progress log read."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_by_priority: dict[int, int] = field(default_factory=dict)
    """Waiting requests per priority (only the priorities of requests waiting now)."""
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_scheduled_tokens_total: int = 0
    """Tokens run through the model, recomputation after preemption included."""
    num_generation_tokens: int = 0
    spec: "SpecDecodeStats | None" = None
    """Speculative decoding's counters (totals), when it is on."""
    lora: "LoRAStats | None" = None
    """LoRA adapters in use, when they are enabled."""
    kv_transfer: KVTransferStats | None = None
    """The KV connector's counters (host tier hits, bytes, swaps), when there is one."""
    mm_encoder_images: int = 0
    """Images the vision encoder ran on (total)."""
    mm_encoder_seconds: float = 0.0
    """The encoder's time on them (total)."""


@dataclass(slots=True)
class LoRAStats:
    """Adapters of the running and waiting requests (names), as vLLM's `lora_requests_info` reports
    them, and the host store's running totals."""

    running: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    max_loras: int = 0
    num_loads: int = 0
    num_evictions: int = 0

    @classmethod
    def total(cls, parts: list[LoRAStats]) -> LoRAStats | None:
        """Several engines' adapters and counters together (None when none serves adapters)."""
        if not parts:
            return None
        return cls(running=sorted({n for p in parts for n in p.running}),
                   waiting=sorted({n for p in parts for n in p.waiting}), max_loras=parts[0].max_loras,
                   num_loads=sum(p.num_loads for p in parts), num_evictions=sum(p.num_evictions for p in parts))


@dataclass(slots=True)
class SpecDecodeStats:
    """Running totals of speculative decoding, as vLLM's `spec_decode_*` metrics count them."""

    num_drafts: int = 0
    """Steps in which a request verified draft tokens."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    """[k]: how often the draft at position i (0-based) was accepted."""

    @classmethod
    def total(cls, parts: list["SpecDecodeStats"]) -> "SpecDecodeStats | None":
        """The sum of several engines' counters (None when none speculates)."""
        if not parts:
            return None
        return cls(sum(p.num_drafts for p in parts), sum(p.num_draft_tokens for p in parts),
                   sum(p.num_accepted_tokens for p in parts),
                   [sum(counts) for counts in zip(*(p.accepted_per_position for p in parts))])
