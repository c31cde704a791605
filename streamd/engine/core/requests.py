"""RequestRegistry: the engine's one record per live request, and the one call that tears it all down.

Everything the engine keeps per request hangs off its `Request`: its sequence group, its beam search state,
whether its sampling needs the token history on the host (which turns off the step overlap while any such
request lives), and its deadlines. `remove(request_id)` ends all of it at once: the record goes, the counts
follow, the teardown hooks run (the grammar matchers of the request's sequences go with them), and its
deadlines no longer apply (they are dropped lazily when they reach the heap's head, so nothing is removed
from the middle of the heap). The scheduler's queues and the output processor's state are their own: the
engine ends a request there in the same call that removes it here.

Plain Python; the beam search state's type is a parameter (`RequestRegistry[BeamSearch]` in the engine), so
this room never imports the torch side that defines it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from streamd.engine.core.deadlines import Deadline, Deadlines
from streamd.engine.core.sequence import SequenceGroup
from streamd.engine.errors import RequestError

S = TypeVar("S")  # the beam search state of a beam search request


@dataclass(slots=True, eq=False)
class Request(Generic[S]):
    """One live request: its sequence group and whatever the engine keeps for it."""

    group: SequenceGroup
    beam: S | None = None  # the beam search state (beam search requests only)

    @property
    def request_id(self) -> str:
        return self.group.request_id

    @property
    def serial(self) -> bool:
        """Its sampling needs its token history on the host (penalties, beam search)."""
        return self.group.sampling_params.needs_host_tokens


class RequestRegistry(Generic[S]):
    def __init__(self) -> None:
        self._requests: dict[str, Request[S]] = {}
        self._deadlines = Deadlines()
        self._teardown: list[Callable[[Request[S]], None]] = []
        self.num_serial = 0  # live requests whose sampling needs their tokens on the host
        self.num_beam = 0  # live beam search requests

    def on_remove(self, hook: Callable[[Request[S]], None]) -> None:
        """`hook(request)` runs when a request is removed (the engine's parts drop their per-request state)."""
        self._teardown.append(hook)

    def check_new(self, request_id: str) -> None:
        """Raises a RequestError if `request_id` is in flight: the engine asks before it makes anything for it."""
        if request_id in self._requests:
            raise RequestError(f"request_id {request_id!r} is already in flight")

    def add(self, group: SequenceGroup, beam: S | None = None) -> Request[S]:
        request_id = group.request_id
        self.check_new(request_id)
        request = self._requests[request_id] = Request(group, beam)
        self.num_serial += request.serial
        self.num_beam += beam is not None
        self._deadlines.add(request_id, group.arrival_time, group.sampling_params)
        return request

    def get(self, request_id: str) -> Request[S] | None:
        return self._requests.get(request_id)

    def remove(self, request_id: str) -> Request[S] | None:
        """Ends everything the engine keeps for the request (idempotent); returns its record if it lived."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.num_serial -= request.serial
            self.num_beam -= request.beam is not None
            for hook in self._teardown:
                hook(request)
        return request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request[S]]:
        """The live requests (a snapshot: removing while iterating is safe)."""
        return iter(list(self._requests.values()))

    # ---- deadlines ------------------------------------------------------------------------------

    def expired(self) -> list[Request[S]]:
        """The live requests whose deadline has passed (each at most once); the clock is read only while
        some deadline is pending."""
        head = self._deadlines.head
        if head is None or head.at > (now := time.monotonic()):
            return []
        due = (self._applies(d) for d in self._deadlines.expired(now))
        return list({id(r): r for r in due if r is not None}.values())

    @property
    def next_deadline(self) -> float | None:
        """The monotonic time of the earliest deadline that still applies; entries of requests that ended
        or were scheduled in time are dropped here."""
        deadlines = self._deadlines
        while (head := deadlines.head) is not None and self._applies(head) is None:
            deadlines.pop()
        return head.at if head is not None else None

    def _applies(self, deadline: Deadline) -> Request[S] | None:
        """The live request a deadline still applies to, if any (a queue deadline ends at first scheduling)."""
        request = self._requests.get(deadline.request_id)
        if request is None or (deadline.queue_only and request.group.first_scheduled_time is not None):
            return None
        return request
