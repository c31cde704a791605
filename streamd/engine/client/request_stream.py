"""Where a request's deltas go on the event loop: the `DeltaSink` protocol and `RequestStream`, the
sink that is an async iterator for one consumer.

A `RequestStream` holds at most one pending `RequestDelta`; deltas that arrive while the consumer is busy
merge into it (text and token ids concatenate), so a slow consumer never makes the engine wait and its
memory is bounded by the request's own output. A `Backpressure` (given a limit) goes further: once the
consumer is more than `max_unsent_tokens` behind, the request is paused in the engine (not scheduled, its
blocks kept) until the consumer is under half of that again. Other sinks (a WebSocket connection's outbox) take the
deltas of many requests and write them together. Lives on the event loop; `AsyncEngine` feeds it.
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

    `set_paused(request_id, paused)` is `AsyncEngine.set_paused`; a `limit` of 0 never pauses. The sink
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


class RequestStream:
    """Async iterator over one request's deltas.

    Cancelling a task blocked in `__anext__`, or calling `cancel()`, aborts the request; the stream then
    ends with the engine's final delta (finish_reason "abort" unless it had already finished).
    """

    def __init__(self, request_id: str, abort: Callable[[str], None], backpressure: Backpressure | None = None) -> None:
        self.request_id = request_id
        self._abort = abort
        self._backpressure = backpressure
        self._unsent = 0  # tokens in the pending delta
        self._pending: RequestDelta | None = None
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
        while self._pending is None:
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
        delta, self._pending = self._pending, None
        self._delivered_final = delta.finished
        if self._backpressure is not None:
            self._unsent = 0
            self._backpressure.update(0)
        return delta

    async def aclose(self) -> None:
        self.cancel()

    def put(self, delta: RequestDelta) -> None:
        """Merges into the pending delta and wakes the consumer."""
        if self._received_final:
            return
        self._received_final = delta.finished
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        if self._backpressure is not None and not delta.finished:
            self._unsent += delta.num_new_tokens
            self._backpressure.update(self._unsent)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
