"""RequestStream and the deltas it yields: one request's output as the event loop sees it.

A `RequestStream` holds at most one pending `RequestDelta`; deltas that arrive while the consumer is busy
merge into it (text and token ids concatenate), so a slow consumer never makes the engine wait and its
memory is bounded by the request's own output. Lives on the event loop; `AsyncEngine` feeds it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from streamd.engine.async_engine import AsyncEngine


@dataclass(slots=True)
class CompletionDelta:
    """What one choice produced since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_tokens: int = 0  # cumulative output tokens of this choice

    def merge(self, later: CompletionDelta) -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.finish_reason = later.finish_reason or self.finish_reason
        self.stop_reason = later.stop_reason if later.stop_reason is not None else self.stop_reason
        self.num_tokens = later.num_tokens


@dataclass(slots=True)
class RequestDelta:
    """One item of a request's stream: the new part of every choice that progressed."""

    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionDelta]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling, when the engine reports it

    def merge(self, later: RequestDelta) -> None:
        by_index = {c.index: c for c in self.outputs}
        for choice in later.outputs:
            if choice.index in by_index:
                by_index[choice.index].merge(choice)
            else:
                self.outputs.append(choice)
        self.finished = self.finished or later.finished
        self.error = self.error or later.error
        self.num_cached_tokens = later.num_cached_tokens
        self.queue_time = self.queue_time if later.queue_time is None else later.queue_time


class StreamObserver(Protocol):
    """Receives request timings (the server's metrics implement it; the engine imports no server code)."""

    def observe_first_token(self, seconds: float) -> None: ...
    def observe_inter_token(self, seconds: float, count: int) -> None: ...
    def observe_finished(self, e2e_seconds: float, queue_seconds: float | None) -> None: ...


class RequestStream:
    """Async iterator over one request's deltas; lives on the event loop.

    Cancelling a task blocked in `__anext__`, or calling `cancel()`, aborts the request; the stream then
    ends with the engine's final delta (finish_reason "abort" unless it had already finished).
    """

    def __init__(self, engine: AsyncEngine, request_id: str, arrival: float) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.queue_time: float | None = None
        self._engine = engine
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
            self._engine._abort(self.request_id)

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

    def _put(self, delta: RequestDelta) -> None:
        """Loop side: merge into the pending delta and wake the consumer."""
        if self._received_final:
            return
        self._received_final = delta.finished
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
