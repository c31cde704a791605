"""Deadlines: when each request must have ended (`timeout_s`) or been scheduled (`queue_timeout_s`).

A heap of (time, request id, kind) kept by the request registry; `expired(now)` pops what is due. Entries
of requests that ended early stay until they reach the head and are then dropped by the registry, so
nothing has to be removed from the middle of the heap.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field

from streamd.engine.sampling_params import SamplingParams


@dataclass(slots=True, order=True, frozen=True)
class Deadline:
    at: float  # monotonic seconds
    request_id: str = field(compare=False)
    queue_only: bool = field(compare=False)  # void once the request has been scheduled


class Deadlines:
    """The deadline heap, earliest first."""

    def __init__(self) -> None:
        self._heap: list[Deadline] = []

    def add(self, request_id: str, arrival: float, params: SamplingParams) -> None:
        if params.timeout_s is not None:
            heapq.heappush(self._heap, Deadline(arrival + params.timeout_s, request_id, False))
        if params.queue_timeout_s is not None:
            heapq.heappush(self._heap, Deadline(arrival + params.queue_timeout_s, request_id, True))

    @property
    def head(self) -> Deadline | None:
        return self._heap[0] if self._heap else None

    def pop(self) -> Deadline:
        return heapq.heappop(self._heap)

    def expired(self, now: float) -> Iterator[Deadline]:
        heap = self._heap
        while heap and heap[0].at <= now:
            yield heapq.heappop(heap)
