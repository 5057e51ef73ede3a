"""The scheduler's waiting queue, one class per `--scheduling-policy`: first come first served, or
by the request's priority (lower first; arrival time breaks ties), as vLLM's.

Both count their requests per priority (the `pagellm:num_requests_waiting_by_priority` gauge), so
that the stats of a step never walk the queue.
"""
from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from pagellm.core.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """A request's place under the priority policy: lower runs first, the earlier arrival among equals."""
    record = request.record
    return record.priority, record.arrival_time


class RequestQueue(Protocol):
    """Waiting requests, the next to admit first."""

    num_by_priority: Counter[int]

    def push(self, request: Request) -> None:
        """A request that has arrived."""

    def push_front(self, request: Request) -> None:
        """A request that was running (preempted): first come first served takes it next."""

    def push_front_all(self, requests: Sequence[Request]) -> None:
        """Requests taken out to let others pass (grammar compiling, adapter slots full), in their order."""

    def peek(self) -> Request:
        """The next request to admit (the queue must not be empty)."""

    def pop_next(self) -> Request:
        """Take the next request to admit."""

    def remove(self, request: Request) -> None:
        """Take out a waiting request (abort)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSRequestQueue(deque):
    """Arrival order; a preempted request goes back to the front (it was admitted before the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_by_priority: Counter[int] = Counter()

    def push(self, request: Request) -> None:
        self.append(request)
        _count(self.num_by_priority, request, 1)

    def push_front(self, request: Request) -> None:
        self.appendleft(request)
        _count(self.num_by_priority, request, 1)

    def push_front_all(self, requests: Sequence[Request]) -> None:
        self.extendleft(reversed(requests))
        for request in requests:
            _count(self.num_by_priority, request, 1)

    def peek(self) -> Request:
        return self[0]

    def pop_next(self) -> Request:
        request = self.popleft()
        _count(self.num_by_priority, request, -1)
        return request

    def remove(self, request: Request) -> None:
        super().remove(request)  # O(n), as aborting a waiting request always was
        _count(self.num_by_priority, request, -1)


class PriorityRequestQueue:
    """A binary heap on (priority, arrival_time): O(log n) to add and to take the next. A removed
    (aborted) request's entry is marked dead and dropped when it reaches the top, so removal is
    O(1) too. A preempted request goes back to its place by priority, not to the front."""

    def __init__(self) -> None:
        self._heap: list[list] = []
        """[priority, arrival_time, push count (unique: Requests are never compared), request or None (removed)]."""
        self._entries: dict[str, list] = {}
        """request_id -> its live heap entry."""
        self._pushes = itertools.count()
        self.num_by_priority: Counter[int] = Counter()

    def push(self, request: Request) -> None:
        entry = [*priority_key(request), next(self._pushes), request]
        self._entries[request.request_id] = entry
        heapq.heappush(self._heap, entry)
        _count(self.num_by_priority, request, 1)

    push_front = push

    def push_front_all(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.push(request)

    def peek(self) -> Request:
        heap = self._heap
        while heap[0][3] is None:
            heapq.heappop(heap)
        return heap[0][3]

    def pop_next(self) -> Request:
        request = self.peek()
        heapq.heappop(self._heap)
        del self._entries[request.request_id]
        _count(self.num_by_priority, request, -1)
        return request

    def remove(self, request: Request) -> None:
        entry = self._entries.pop(request.request_id)
        entry[3] = None
        _count(self.num_by_priority, request, -1)

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        """In admission order (sorts: for tests and debugging, not the step loop)."""
        return (entry[3] for entry in sorted(self._entries.values()))


QUEUES: dict[str, type[RequestQueue]] = {"fcfs": FCFSRequestQueue, "priority": PriorityRequestQueue}
"""The waiting queue of each `--scheduling-policy`."""
SCHEDULING_POLICIES = tuple(QUEUES)


def create_request_queue(policy: str) -> RequestQueue:
    if policy not in QUEUES:
        raise ValueError(f"scheduling_policy (--scheduling-policy) must be one of {', '.join(SCHEDULING_POLICIES)}, "
                         f"got {policy!r}")
    return QUEUES[policy]()


def _count(counter: Counter[int], request: Request, delta: int) -> None:
    priority = request.record.priority
    counter[priority] += delta
    if counter[priority] <= 0:
        del counter[priority]
