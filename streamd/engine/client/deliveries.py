"""The event-loop half that every engine client shares: where each request's deltas go.

`Deliveries` keeps each submitted request's `DeltaSink` and its admission future, and applies a published
`StepBatch`: admissions resolved or refused, each delta handed to its request's sink (the sink is
forgotten after the final one), the stats snapshot kept. When the engine dies it fails every admission and
ends every stream with an error. Both clients own one; they differ only in how commands reach the engine
loop and how its batches come back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from streamd.engine.client.loop import StepBatch
from streamd.engine.client.protocol import DuplicateRequestError, EngineDeadError
from streamd.engine.client.request_stream import DeltaSink
from streamd.engine.outputs import RequestDelta
from streamd.engine.stats import EngineStats


class Deliveries:
    """Sinks, admissions and the latest stats of one client, on its event loop."""

    def __init__(self, stats: EngineStats) -> None:
        self.sinks: dict[str, DeltaSink] = {}
        self.admissions: dict[str, asyncio.Future[None]] = {}
        self.stats = stats
        self.dead: str | None = None

    @property
    def num_waiting(self) -> int:
        """The last snapshot's waiting requests plus submissions not admitted yet."""
        return self.stats.scheduler.num_waiting + len(self.admissions)

    def in_flight(self) -> list[str]:
        return list(self.sinks)

    async def admit(
        self, request_id: str, sink: DeltaSink, send: Callable[[], None], abort: Callable[[str], None]
    ) -> None:
        """Registers `sink`, `send`s the request's add, and waits for its admission (raising its refusal).
        Cancelled while waiting, the request is aborted: admitted or not, the engine lets go of it."""
        if request_id in self.sinks:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sinks[request_id] = sink
        self.admissions[request_id] = admitted
        send()
        try:
            await asyncio.shield(admitted)
        except asyncio.CancelledError:
            abort(request_id)
            raise

    def deliver(self, batch: StepBatch) -> None:
        """Applies one published batch."""
        for request_id in batch.accepted:
            future = self.admissions.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(None)
        for rejection in batch.rejected:
            self.sinks.pop(rejection.request_id, None)
            future = self.admissions.pop(rejection.request_id, None)
            if future is not None and not future.done():
                future.set_exception(rejection.error)
        sinks = self.sinks
        for delta in batch.deltas:
            sink = sinks.get(delta.request_id)
            if sink is not None:
                if delta.finished:
                    del sinks[delta.request_id]
                sink.put(delta)
        if batch.stats is not None:
            self.stats = batch.stats
        if batch.dead is not None:
            self.mark_dead(batch.dead)

    def mark_dead(self, reason: str) -> None:
        """Fails every admission and ends every stream with `reason`."""
        self.dead = reason
        for future in self.admissions.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for request_id, sink in self.sinks.items():
            sink.put(RequestDelta(request_id, 0, [], finished=True, error=reason))
        self.admissions.clear()
        self.sinks.clear()
