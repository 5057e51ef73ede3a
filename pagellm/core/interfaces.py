"""What the scheduler needs of the parts it drives but does not own: a request's grammar, the
grammar compiler, a proposer of draft tokens that runs beside it, and the store of LoRA adapters.
Their implementations live in higher layers (`pagellm.structured_output`, `pagellm.spec_decode`,
`pagellm.lora`) and are handed to the scheduler by the engine, so that `core` stays pure Python and
imports none of them."""
from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Protocol

from pagellm.lora_request import LoRARequest
from pagellm.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import numpy as np


class Grammar(Protocol):
    """One request's structured-output grammar: compiled off the step loop, then a matcher."""

    @property
    def active(self) -> bool:
        """Whether the next token is constrained."""

    def ready(self) -> bool:
        """Whether the matcher exists; raises a ValueError if the compile failed or timed out."""

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; True when the output is complete (ValueError: the token
        breaks the grammar)."""

    def cancel(self) -> None:
        """The request is gone."""


class GrammarCompiler(Protocol):
    """Starts requests' grammars and fills a step's token bitmask from them."""

    def start(self, params: StructuredOutputsParams, prompt_token_ids: list[int],
              eos_token_ids: Collection[int]) -> Grammar: ...

    def bitmask(self, grammars: list[Grammar]) -> np.ndarray:
        """int32 [len(grammars), ceil(vocab / 32)]: the tokens each grammar allows next."""

    def wait(self, timeout_s: float) -> None:
        """Block until a compile finishes or `timeout_s` passes."""


class DraftProposer(Protocol):
    """Proposes draft tokens for a request about to decode, beside the scheduler (speculative
    decoding's host-side proposers, such as n-gram prompt lookup)."""

    def propose(self, token_ids: list[int], max_tokens: int, req_id: str | None = None,
                num_prompt_tokens: int = 0) -> list[int]:
        """Up to `max_tokens` draft tokens to follow `token_ids` (the first `num_prompt_tokens` the
        prompt's, 0: not told); state may be kept per `req_id`."""

    def forget(self, req_id: str) -> None:
        """Drop what was kept for a finished request."""


class AdapterStore(Protocol):
    """LoRA adapters in host memory and on the workers: loaded off the step loop when a request
    first needs one, and dropped (least recently used first) only when no running request uses them."""

    max_loras: int
    """Distinct adapters one step may hold."""
    num_loads: int
    """Adapters loaded so far (reloads after eviction included)."""
    num_evictions: int

    def ready(self, lora: LoRARequest, in_use: Collection[int]) -> bool:
        """Whether the adapter is loaded and on the workers; starts its load if not. `in_use`: the ids
        of adapters running requests use, which must not be dropped to make room. Raises a
        ValueError if its load failed."""

    def wait(self, timeout_s: float) -> None:
        """Block until a load finishes or `timeout_s` passes."""
