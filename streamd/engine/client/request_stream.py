"""Where a request's deltas go on the event loop: the `DeltaSink` protocol, the `PendingDelta` every sink
keeps, and `RequestStream`, the sink that is an async iterator for one consumer.

A sink holds at most one pending `RequestDelta` (`PendingDelta`); deltas that arrive while its consumer is
busy merge into it (text and token ids concatenate), so a slow consumer never makes the engine wait and its
memory is bounded by the request's own output. A `Backpressure` (given a limit) goes further: once the
consumer is more than `max_unsent_tokens` behind, the request is paused in the engine (not scheduled, its
blocks kept) until the consumer is under half of that again. Other sinks (a WebSocket connection's
requests) keep the same `PendingDelta` and are written together. Lives on the event loop; an
`EngineClient` feeds it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from streamd.engine.outputs import RequestDelta


class DeltaSink(Protocol):
    """Receives one request's deltas on the event loop, in order; the last one has `finished` set."""

    def put(self, delta: RequestDelta) -> None: ...


@dataclass(slots=True)
class Backpressure:
    """Pauses a request whose consumer fell `limit` tokens behind, until it is under half of that.

    `set_paused(request_id, paused)` is `EngineClient.set_paused`; a `limit` of 0 never pauses. The sink
    calls `update(unsent)` whenever its count of produced-but-unsent tokens changes."""

    request_id: str
    limit: int
    set_paused: Callable[[str, bool], None]
    paused: bool = False

    def update(self, unsent: int) -> None:
        if not self.limit:
            return
        if not self.paused and unsent > self.limit:
            self.paused = True
            self.set_paused(self.request_id, True)
        elif self.paused and unsent * 2 < self.limit:
            self.paused = False
            self.set_paused(self.request_id, False)


class PendingDelta:
    """A sink's delta not yet taken by its consumer, and the tokens in it (what `Backpressure` counts).

    `add` merges a newer delta in; `take` hands it over (the consumer caught up: a paused request resumes).
    The `backpressure`, once set, hears every change of the count."""

    __slots__ = ("backpressure", "delta", "unsent")

    def __init__(self, backpressure: Backpressure | None = None) -> None:
        self.delta: RequestDelta | None = None
        self.unsent = 0  # tokens in `delta` (a final delta's are not counted: nothing follows it)
        self.backpressure = backpressure

    def add(self, delta: RequestDelta) -> None:
        if self.delta is None:
            self.delta = delta
        else:
            self.delta.merge(delta)
        if not delta.finished:
            self.unsent += delta.num_new_tokens
            if self.backpressure is not None:
                self.backpressure.update(self.unsent)

    def take(self) -> RequestDelta | None:
        """The pending delta (None if nothing came), handed to the consumer."""
        delta, self.delta = self.delta, None
        self.unsent = 0
        if self.backpressure is not None:
            self.backpressure.update(0)
        return delta

    def drop(self) -> RequestDelta | None:
        """The pending delta, for bookkeeping only: nobody will read it (the request stays paused)."""
        delta, self.delta = self.delta, None
        return delta


class RequestStream:
    """Async iterator over one request's deltas.

    Cancelling a task blocked in `__anext__`, or calling `cancel()`, aborts the request; the stream then
    ends with the engine's final delta (finish_reason "abort" unless it had already finished).
    """

    def __init__(self, request_id: str, abort: Callable[[str], None], backpressure: Backpressure | None = None) -> None:
        self.request_id = request_id
        self._abort = abort
        self._pending = PendingDelta(backpressure)
        self._waiter: asyncio.Future[None] | None = None
        self._received_final = False  # the engine's last delta arrived
        self._delivered_final = False  # ... and the consumer took it
        self._cancelled = False

    @property
    def finished(self) -> bool:
        return self._received_final

    def cancel(self) -> None:
        if not self._received_final and not self._cancelled:
            self._cancelled = True
            self._abort(self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        while self._pending.delta is None:
            if self._delivered_final:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except asyncio.CancelledError:
                self.cancel()
                raise
            finally:
                self._waiter = None
        delta = self._pending.take()
        assert delta is not None
        self._delivered_final = delta.finished
        return delta

    async def aclose(self) -> None:
        self.cancel()

    def put(self, delta: RequestDelta) -> None:
        """Merges into the pending delta and wakes the consumer."""
        if self._received_final:
            return
        self._received_final = delta.finished
        self._pending.add(delta)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
