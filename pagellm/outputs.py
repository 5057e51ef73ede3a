"""What the offline API returns, shaped as vLLM's RequestOutput / CompletionOutput."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    finish_reason: str | None = None
    """stop | length | abort, or None while still generating."""
    stop_reason: int | str | None = None
    """The stop token id (or string) that ended generation; None for EOS or length."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and its outputs so far (cumulative)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    metrics: dict[str, float] = field(default_factory=dict)
    """arrival_time, first_token_time, finished_time (time.monotonic seconds)."""
