"""Readiness and graceful drain: what is in flight, and how it is wound down on SIGTERM.

`Lifecycle` holds the requests in flight (any route: each one's `RequestAccount` adds itself when the
request is submitted and leaves when it is counted) and the open WebSockets. `drain()` turns `/ready`
to 503 and refuses new work, lets in-flight requests finish for up to `drain_timeout_s`, then cancels the
rest (each still gets its `done` once the engine confirms the abort), and finally closes every WebSocket
with the code it registered (1012, service restart, for `/v1/stream` and the Responses socket, which the OpenAI SDK
reconnects after). Waits are on events, never on sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

from streamd.engine import EngineClient
from streamd.logs import get_logger

logger = get_logger(__name__)

# After cancelling at the drain deadline, how long the engine gets to confirm the aborts.
CANCEL_GRACE_S = 10.0


class InFlight(Protocol):
    """A request in flight, as the drain sees it."""

    def cancel(self, cause: str = "abort") -> None: ...


class Lifecycle:
    def __init__(self, engine: EngineClient, drain_timeout_s: float) -> None:
        self.engine = engine
        self.drain_timeout_s = drain_timeout_s
        self.warmed_up = False
        self.draining = False
        self._active: set[InFlight] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closers: dict[object, tuple[Callable[[int], Awaitable[None]], int]] = {}
        self._drained: asyncio.Event | None = None
        self._on_drain: list[Callable[[], None]] = []

    @property
    def ready(self) -> bool:
        return self.warmed_up and not self.draining and self.engine.ready

    @property
    def status(self) -> str:
        """What `/ready` says: ready, draining, warming_up or engine_unavailable."""
        if self.ready:
            return "ready"
        return "draining" if self.draining else "warming_up" if not self.warmed_up else "engine_unavailable"

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_connections(self) -> int:
        return len(self._closers)

    def add(self, request: InFlight) -> None:
        self._active.add(request)
        self._idle.clear()

    def discard(self, request: InFlight) -> None:
        self._active.discard(request)
        if not self._active:
            self._idle.set()

    @contextmanager
    def connection(self, key: object, close: Callable[[int], Awaitable[None]], code: int = 1001) -> Iterator[None]:
        """Registers an open WebSocket and how to close it at the end of a drain (with `code`)."""
        self._closers[key] = (close, code)
        try:
            yield
        finally:
            self._closers.pop(key, None)

    def on_drain(self, callback: Callable[[], None]) -> None:
        """`callback()` runs when a drain starts (the resume store ends requests whose client is gone)."""
        self._on_drain.append(callback)

    async def drain(self) -> None:
        """Idempotent; a second call waits for the first."""
        if self._drained is not None:
            await self._drained.wait()
            return
        self._drained = asyncio.Event()
        self.draining = True
        logger.info(
            "drain_started", in_flight=self.num_active, connections=self.num_connections, timeout_s=self.drain_timeout_s
        )
        for callback in self._on_drain:
            callback()
        if not await _wait(self._idle, self.drain_timeout_s):
            logger.warning("drain_timeout_cancelling", in_flight=self.num_active)
            for request in list(self._active):
                request.cancel("drain")
            if not await _wait(self._idle, CANCEL_GRACE_S):
                logger.error("drain_abort_unconfirmed", in_flight=self.num_active)
        closers = list(self._closers.values())
        await asyncio.gather(*(close(code) for close, code in closers), return_exceptions=True)
        logger.info("drain_finished", closed_connections=len(closers))
        self._drained.set()


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except TimeoutError:
        return False
