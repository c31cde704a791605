"""Where a request's deltas go on the event loop: the `DeltaSink` protocol and `RequestStream`, the
sink that is an async iterator for one consumer.

A `RequestStream` holds at most one pending `RequestDelta`; deltas that arrive while the consumer is busy
merge into it (text and token ids concatenate), so a slow consumer never makes the engine wait and its
memory is bounded by the request's own output. Other sinks (a WebSocket connection's outbox) take the
deltas of many requests and write them together. Lives on the event loop; `AsyncEngine` feeds it.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol

from streamd.engine.outputs import RequestDelta


class DeltaSink(Protocol):
    """Receives one request's deltas on the event loop, in order; the last one has `finished` set."""

    def put(self, delta: RequestDelta) -> None: ...


class RequestStream:
    """Async iterator over one request's deltas.

    Cancelling a task blocked in `__anext__`, or calling `cancel()`, aborts the request; the stream then
    ends with the engine's final delta (finish_reason "abort" unless it had already finished).
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort = abort
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
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
