"""Background Responses (`background: true` on `POST /v1/responses`, and streamd's `streamd_background: true`
on streamed chat completions and completions): a response that runs detached from the HTTP request that
created it, so a dropped SSE stream loses nothing.

Each one is a `BackgroundResponse`: a task drives its `DetachedRun` to the end whoever listens, keeping every
event (they are numbered by `sequence_number` from 0, so event i is number i). Any number of readers follow
it: `GET /v1/responses/{id}?stream=true&starting_after=N` replays the kept events after N, then the live ones
until the terminal event. It is bound to the API key that created it (another key's lookups answer 404, as
for an unknown id). Retention is bounded: at most `server.max_background_responses` at once (a new one
evicts the oldest finished one; when all are running it is refused with 503 `overloaded`), each finished one
kept `server.background_retention_s` and then forgotten. Its events are bounded by its own `max_tokens`
(the context length at most), as a WebSocket resume's retained frames are by the request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamd.server.errors import ServiceError


class DetachedRun(Protocol):
    """What a background response runs (`responses.ResponseRun`; a protocol so that this module, which
    `Services` holds, does not import the Responses core, which imports `Services`)."""

    @property
    def id(self) -> str: ...

    def events(self) -> AsyncIterator[Any]: ...  # the Responses API's event dicts, or a call's SSE bytes

    def finish(self) -> None: ...

    def cancel(self) -> None: ...

    def snapshot(self, done: bool) -> dict[str, Any]: ...


Keep = Callable[[], None]  # what to do once it has finished (Responses: store it for previous_response_id)


@dataclass(slots=True, eq=False)
class BackgroundResponse:
    """One detached response: its run, every event it produced, and who may read it."""

    key: str = field(repr=False)  # the API key that created it ("" without keys; never in a repr or log)
    kind: str  # the route family that reaches it ("responses", "chat", "completion")
    run: DetachedRun
    events: list[Any] = field(default_factory=list)
    done: bool = False
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # replaced (after being set) on each event
    expiry: asyncio.TimerHandle | None = None  # once finished: when it is forgotten (cancelled if sooner)

    @property
    def id(self) -> str:
        return self.run.id

    def add(self, event: Any) -> None:
        self.events.append(event)
        self.wake()

    def wake(self) -> None:
        woken, self.changed = self.changed, asyncio.Event()
        woken.set()

    async def replay(self, starting_after: int) -> AsyncIterator[tuple[int, Any]]:
        """The events numbered after `starting_after`, then the live ones until the last, each with its number."""
        index = max(starting_after + 1, 0)
        while True:
            while index < len(self.events):
                yield index, self.events[index]
                index += 1
            if self.done:
                return
            await self.changed.wait()

    async def ended(self) -> dict[str, Any]:
        """The `response` object once it has ended (its terminal event kept)."""
        while not self.done:
            await self.changed.wait()
        return self.response()

    def response(self) -> dict[str, Any]:
        """The `response` object as of now (queued, in progress, or as it ended)."""
        return self.run.snapshot(self.done)


class BackgroundResponses:
    """The background responses of this server, by id (see the module docstring for the bounds)."""

    def __init__(self, max_responses: int, retention_s: float) -> None:
        self.max_responses = max_responses
        self.retention_s = retention_s
        self._records: dict[str, BackgroundResponse] = {}  # oldest first
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._records)

    def start(self, key: str, kind: str, run: DetachedRun, keep: Keep | None = None) -> BackgroundResponse:
        """Runs `run` detached (its events kept); `keep` stores it once it has finished. Refused (the run
        finished, i.e. aborted) when every place holds a running response."""
        try:
            self.make_room()
        except ServiceError:
            run.finish()
            raise
        record = self._records[run.id] = BackgroundResponse(key, kind, run)
        task = asyncio.ensure_future(self._drive(record, keep))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return record

    def get(self, key: str, kind: str, response_id: str) -> BackgroundResponse:
        record = self._records.get(response_id)
        if record is None or record.key != key or record.kind != kind:
            raise ServiceError(
                "not_found", f"no background response {response_id!r} (unknown, expired or another key's)"
            )
        return record

    def cancel(self, key: str, kind: str, response_id: str) -> BackgroundResponse:
        """Aborts it if it still runs (its terminal event follows, status `cancelled`)."""
        record = self.get(key, kind, response_id)
        if not record.done:
            record.run.cancel()
        return record

    def delete(self, key: str, kind: str, response_id: str) -> None:
        self._forget(self.cancel(key, kind, response_id))

    def make_room(self) -> None:
        """Evicts the oldest finished response when full; raises 503 `overloaded` when all are running."""
        if len(self._records) < self.max_responses:
            return
        oldest = next((r for r in self._records.values() if r.done), None)
        if oldest is None:
            raise ServiceError(
                "overloaded", f"{self.max_responses} background responses are running (server.max_background_responses)"
            )
        self._forget(oldest)

    async def _drive(self, record: BackgroundResponse, keep: Keep | None) -> None:
        run = record.run
        try:
            async for event in run.events():
                record.add(event)
        finally:
            run.finish()
            record.done = True
            record.wake()
        if keep is not None:
            keep()
        if self._records.get(record.id) is record:  # (not deleted or evicted meanwhile)
            record.expiry = asyncio.get_running_loop().call_later(self.retention_s, self._forget, record)

    def _forget(self, record: BackgroundResponse) -> None:
        """Drops it, and its expiry timer: an evicted or deleted one is not held (events and all) by the loop
        until its retention would have ended, so `max_responses` bounds the memory, not the request rate."""
        del self._records[record.id]
        if record.expiry is not None:
            record.expiry.cancel()
