"""`BackgroundResponses` on its own (no engine, no HTTP: the routes are tested in tests/server/http/
test_background_*.py): its bounds (at most `max_responses`, the oldest finished one evicted and let go, 503
when all run), the retention of a finished one, numbered replay, and the binding to a key and a route family."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from streamd.server.background import BackgroundResponses
from streamd.server.errors import ServiceError


class FakeRun:
    """A `DetachedRun` whose events the test hands in (None ends it)."""

    def __init__(self, run_id: str) -> None:
        self.id = run_id
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = self.cancelled = False

    async def events(self) -> AsyncIterator[Any]:
        while (event := await self.queue.get()) is not None:
            yield event

    def finish(self) -> None:
        self.finished = True

    def cancel(self) -> None:
        self.cancelled = True
        self.queue.put_nowait("cancelled")
        self.queue.put_nowait(None)

    def snapshot(self, done: bool) -> dict[str, Any]:
        return {"id": self.id, "status": ("cancelled" if self.cancelled else "completed") if done else "in_progress"}


async def _ended(store: BackgroundResponses, run: FakeRun) -> None:
    run.queue.put_nowait(None)
    await store.get("k", "chat", run.id).ended()


def _code(store: BackgroundResponses, key: str, kind: str, run_id: str) -> str | None:
    try:
        store.get(key, kind, run_id)
    except ServiceError as exc:
        return exc.code
    return None


async def test_full_evicts_the_oldest_finished_and_refuses_when_all_run() -> None:
    store = BackgroundResponses(max_responses=2, retention_s=60)
    a, b, c, d = (FakeRun(name) for name in "abcd")
    store.start("k", "chat", a)
    store.start("k", "chat", b)
    with pytest.raises(ServiceError) as refused:
        store.start("k", "chat", c)
    assert refused.value.code == "overloaded" and c.finished and len(store) == 2
    await _ended(store, b)
    finished = store.get("k", "chat", "b")
    assert finished.expiry is not None and not finished.expiry.cancelled()
    store.start("k", "chat", d)  # evicts b (finished), not a (running)
    assert _code(store, "k", "chat", "b") == "not_found" and _code(store, "k", "chat", "a") is None
    assert finished.expiry.cancelled()  # the loop no longer holds the evicted one until its retention ends
    store.cancel("k", "chat", "a")
    await _ended(store, d)


async def test_a_finished_one_is_kept_for_the_retention_then_forgotten() -> None:
    store = BackgroundResponses(max_responses=4, retention_s=0.05)
    run, kept = FakeRun("r"), []
    store.start("k", "chat", run, lambda: kept.append(run.id))
    await _ended(store, run)
    assert kept == ["r"] and run.finished and _code(store, "k", "chat", "r") is None
    await asyncio.sleep(0.2)  # past the retention (a timer's period: what is tested)
    assert _code(store, "k", "chat", "r") == "not_found" and len(store) == 0


async def test_replay_is_numbered_and_cancel_ends_it() -> None:
    store = BackgroundResponses(max_responses=4, retention_s=60)
    run = FakeRun("r")
    record = store.start("k", "chat", run)
    for event in ("e0", "e1", "e2"):
        run.queue.put_nowait(event)
    reader = asyncio.ensure_future(_collect(record.replay(0)))
    assert await store.cancel("k", "chat", "r").ended() == {"id": "r", "status": "cancelled"}
    assert await reader == [(1, "e1"), (2, "e2"), (3, "cancelled")]
    assert [n for n, _ in await _collect(record.replay(-5))] == [0, 1, 2, 3]


async def test_another_key_or_route_family_does_not_find_it() -> None:
    store = BackgroundResponses(max_responses=4, retention_s=60)
    run = FakeRun("r")
    store.start("k", "chat", run)
    assert _code(store, "other", "chat", "r") == _code(store, "k", "completion", "r") == "not_found"
    with pytest.raises(ServiceError):
        store.delete("other", "chat", "r")
    assert not run.cancelled
    store.delete("k", "chat", "r")
    assert run.cancelled and _code(store, "k", "chat", "r") == "not_found"


async def _collect(events: AsyncIterator[Any]) -> list[Any]:
    return [event async for event in events]
