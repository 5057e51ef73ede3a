"""A streaming request's outputs on their way from the output loop to the request's consumer."""
from __future__ import annotations

import asyncio
import dataclasses
from collections import deque

from pagellm.outputs import CompletionOutput, RequestOutput


class OutputMailbox:
    """Outputs (or the exception that ends the request) in arrival order. With `coalesce` (DELTA
    outputs), an output that arrives while the consumer has not yet taken the one before it is
    merged into that one: a client that reads slower than the engine writes gets fewer, larger
    chunks instead of a growing backlog, and the server does the per-chunk work once per read."""

    __slots__ = ("_items", "_ready", "_coalesce")

    def __init__(self, coalesce: bool) -> None:
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        self._coalesce = coalesce

    def put(self, item: RequestOutput | BaseException) -> None:
        if self._coalesce and self._items and isinstance(item, RequestOutput):
            last = self._items[-1]
            if isinstance(last, RequestOutput):
                merged = merge_deltas(last, item)
                if merged is not None:
                    self._items[-1] = merged
                    return
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


def merge_deltas(first: RequestOutput, then: RequestOutput) -> RequestOutput | None:
    """Two consecutive DELTA outputs of one request as one, or None when they do not merge simply
    (several sequences, or different ones: n > 1 keeps its outputs apart)."""
    if first.finished or len(first.outputs) != 1 or len(then.outputs) != 1:
        return None
    a, b = first.outputs[0], then.outputs[0]
    if a.index != b.index:
        return None
    logprobs = None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or ()), *(b.logprobs or ())]
    joined = CompletionOutput(a.index, a.text + b.text, a.token_ids + b.token_ids, b.cumulative_logprob, logprobs,
                              b.finish_reason, b.stop_reason)
    return dataclasses.replace(then, outputs=[joined], prompt_logprobs=first.prompt_logprobs or then.prompt_logprobs,
                               metrics={**first.metrics, **then.metrics})
