"""What the offline API returns, shaped as vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log probability under the model's raw distribution, as vLLM's Logprob."""

    logprob: float
    rank: int | None = None
    """1 + the number of tokens with a strictly higher logprob (1 is the most likely)."""
    decoded_token: str | None = None
    """The token alone as text; None with detokenize=False."""


SampleLogprobs = list[dict[int, Logprob]]
"""Per generated token: its own logprob and the top-k, keyed by token id."""
PromptLogprobs = list[dict[int, Logprob] | None]
"""Per prompt token, like SampleLogprobs; the first prompt token has None (nothing predicts it)."""


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    """Sum of the generated tokens' logprobs; None unless the request asked for logprobs."""
    logprobs: SampleLogprobs | None = None
    """None unless the request asked for logprobs."""
    finish_reason: str | None = None
    """stop | length | abort, or None while still generating."""
    stop_reason: int | str | None = None
    """The stop token id (or string) that ended generation; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and its outputs: everything so far, or only what is new with output_kind
    DELTA. With n > 1, `outputs[i]` is sequence i (DELTA: only the sequences that changed)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    metrics: dict[str, float] = field(default_factory=dict)
    """arrival_time, first_token_time, finished_time (time.monotonic seconds)."""
    prompt_logprobs: PromptLogprobs | None = None
    """None unless the request asked for prompt_logprobs."""
    kv_transfer_params: dict | None = None
    """Set when it finishes on a prefill engine (kv_producer) that asked `do_remote_decode`: what the
    decode engine needs to pull its KV (docs/disaggregated.md)."""


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's pooled vector, as vLLM's EmbeddingOutput."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` returns per prompt, as vLLM's EmbeddingRequestOutput."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
