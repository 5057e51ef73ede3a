"""Admission by work: the sequences and tokens that generation requests ask of the engine, bounded
in total (`--max-seqs-in-flight`, `--max-tokens-in-flight`).

Counting requests is not enough: `{"prompt": [64 prompts], "n": 128}` is one request and 8,192
sequences, which would hold the engine for minutes while every small request behind it times out.
A request whose work does not fit now waits for room, for at most `--queue-timeout` seconds and
with at most `--max-waiting-requests` others; past either, it gets a 503 (with `Retry-After`, set by
the traffic middleware). Waiting requests are admitted in arrival order as room frees up, and one
that does not fit does not hold back a later one that does, so small requests keep flowing, until
it has waited `patience_s` (a quarter of the queue timeout): from then on the room that frees is
kept for it, and later requests wait behind it. Without that, a request of two sequences under a
steady stream of one-sequence requests would almost never find two free at once. A request larger
than the whole budget is charged the whole budget: it runs once nothing else is in flight.

Under `--scheduling-policy priority` the waiting requests are admitted by (priority, arrival)
instead: room goes to the best priority first, and the patience rule holds within that order (a
request that has waited `patience_s` keeps the room for itself against requests of its priority or
a lower one; a request of a higher priority still passes it). Under fcfs every priority is 0 and
this is the arrival order above.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from starlette.types import Scope

from pagellm.entrypoints.openai.errors import APIError
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

TICKET_SCOPE_KEY = "pagellm.ticket"
"""Where the traffic middleware puts a generation request's Ticket in the ASGI scope."""
DEFAULT_PATIENCE_S = 10.0
"""How long a waiting request lets later ones pass it when waits are not bounded (no --queue-timeout)."""


@dataclass(frozen=True, slots=True)
class Work:
    """What a request asks of the engine."""

    seqs: int
    """Sequences it generates (or embeds): its prompts times `n` (or `best_of`)."""
    tokens: int
    """Tokens those sequences may reach: the prompt plus max_tokens (at most max_model_len) for each."""

    @classmethod
    def of(cls, prompt_lens: Sequence[int], params: SamplingParams | PoolingParams, max_model_len: int) -> "Work":
        """The work of a request whose prompts are `prompt_lens` tokens long (before truncate_prompt_tokens):
        `n` (or `best_of`) sequences a prompt for generation, one for pooling."""
        if params.truncate_prompt_tokens is not None:
            prompt_lens = [min(n, params.truncate_prompt_tokens) for n in prompt_lens]
        if isinstance(params, PoolingParams):
            return cls(len(prompt_lens), sum(prompt_lens))
        per_prompt = params.best_of or params.n
        # A sequence ends at max_model_len whatever max_tokens says, and reaches it without one.
        reach = [max_model_len if params.max_tokens is None else min(n + params.max_tokens, max_model_len)
                 for n in prompt_lens]
        return cls(per_prompt * len(prompt_lens), per_prompt * sum(reach))


class Refused(APIError):
    """503: no room for the request. `why` ("at_capacity" or "queue_timeout") is counted in metrics."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message, 503)
        self.why = why


class Admission:
    """The work admitted to the engine, and the requests waiting for room (see the module's docstring)."""

    def __init__(self, max_seqs: int, max_tokens: int | None, max_waiting: int,
                 queue_timeout_s: float | None, patience_s: float | None = None) -> None:
        self.max_seqs = max_seqs
        self.max_tokens = max_tokens
        """None: no bound on tokens."""
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        """None: a request waits until there is room."""
        self.patience_s = patience_s if patience_s is not None else (
            DEFAULT_PATIENCE_S if queue_timeout_s is None else queue_timeout_s / 4)
        """How long a waiting request lets later ones pass it (see the module's docstring)."""
        self.seqs = 0
        self.tokens = 0
        self._waiting: dict[int, dict[asyncio.Future[None], tuple[Work, float]]] = {}
        """Per priority, each waiting request's grant, the work it was charged and when it began to
        wait, in arrival order (a priority's dict goes when its last request does)."""
        self._num_waiting = 0

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def full_reason(self) -> str | None:
        """Why even a one-sequence request would be refused now (None: it would be admitted or wait)."""
        at_limit = self.seqs >= self.max_seqs or (self.max_tokens is not None and self.tokens >= self.max_tokens)
        return self._queue_full_reason() if at_limit else None

    def _queue_full_reason(self) -> str | None:
        if self._num_waiting < self.max_waiting:
            return None
        return (f"the server is at capacity ({self.seqs} sequences and {self.tokens} tokens in flight, "
                f"{self._num_waiting} requests waiting for room, the most --max-waiting-requests allows)")

    async def acquire(self, work: Work, priority: int = 0) -> Work:
        """Admit `work` (of a request of `priority`, lower first), waiting for room if need be;
        returns what it was charged, for `release`. Refused when too many requests wait already, or
        when it waited past the queue timeout."""
        charged = Work(min(work.seqs, self.max_seqs),
                       work.tokens if self.max_tokens is None else min(work.tokens, self.max_tokens))
        if self._fits(charged) and not self._held_back(priority):
            self._take(charged)
            return charged
        full = self._queue_full_reason()
        if full is not None:
            raise Refused(f"{full}; this request asks for {work.seqs} sequences and {work.tokens} tokens",
                          "at_capacity")
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(priority, {})[granted] = (charged, time.monotonic())
        self._num_waiting += 1
        try:
            await asyncio.wait((granted,), timeout=self.queue_timeout_s)
        except BaseException:  # cancelled: the client left, or its request timeout passed
            self._leave(granted, charged, priority)
            raise
        if not granted.done():
            self._leave(granted, charged, priority)
            raise Refused(f"the request waited {self.queue_timeout_s:g} s (--queue-timeout) for room for its "
                          f"{work.seqs} sequences and {work.tokens} tokens ({self.seqs} sequences and "
                          f"{self.tokens} tokens in flight); ask for less, or retry", "queue_timeout")
        return charged

    def _leave(self, granted: asyncio.Future[None], charged: Work, priority: int) -> None:
        """A waiting request gives up: out of the queue, or, granted in the same instant, gives its room back."""
        if granted.done():
            self.release(charged)
        else:
            self._dequeue(priority, granted)

    def _dequeue(self, priority: int, granted: asyncio.Future[None]) -> None:
        level = self._waiting[priority]
        del level[granted]
        self._num_waiting -= 1
        if not level:
            del self._waiting[priority]

    def release(self, charged: Work) -> None:
        """Give back what `acquire` charged, and admit the waiting requests that fit now."""
        self.seqs -= charged.seqs
        self.tokens -= charged.tokens
        now = time.monotonic()
        # Few distinct priorities wait at once (one under fcfs): sorting them is cheap.
        for priority in sorted(self._waiting):
            for granted, (work, since) in list(self._waiting[priority].items()):
                if granted.done():
                    continue
                if self._fits(work):
                    self._dequeue(priority, granted)
                    self._take(work)
                    granted.set_result(None)
                elif now - since >= self.patience_s:
                    return  # the room that frees is kept for it

    def _held_back(self, priority: int) -> bool:
        """Whether a request of `priority` may not pass the waiting ones: the oldest of some priority
        as good as its own has waited `patience_s`."""
        now = time.monotonic()
        return any(now - next(iter(level.values()))[1] >= self.patience_s
                   for p, level in self._waiting.items() if p <= priority)

    def _fits(self, work: Work) -> bool:
        return (self.seqs + work.seqs <= self.max_seqs
                and (self.max_tokens is None or self.tokens + work.tokens <= self.max_tokens))

    def _take(self, work: Work) -> None:
        self.seqs += work.seqs
        self.tokens += work.tokens


class Ticket:
    """One generation request's place in the Admission: admitted once by its handler, released by
    the traffic middleware when the response has ended (also when it was never admitted)."""

    def __init__(self, admission: Admission, on_refused: Callable[[str], None]) -> None:
        self._admission = admission
        self._on_refused = on_refused
        self._held: Work | None = None

    async def admit(self, work: Work, priority: int = 0) -> None:
        if self._held is not None:
            raise RuntimeError("a request is admitted once")
        try:
            self._held = await self._admission.acquire(work, priority)
        except Refused as e:
            self._on_refused(e.why)
            raise

    def release(self) -> None:
        if self._held is not None:
            self._admission.release(self._held)
            self._held = None


def ticket_of(scope: Scope) -> Ticket:
    """The Ticket the traffic middleware gave this generation request."""
    return scope[TICKET_SCOPE_KEY]
