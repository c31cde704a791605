"""`http.common.Keepalive` on its own (no server, no proxy: test_keepalive.py has those): it writes `: keepalive`
only into silence, stops with the body, and waits for a write stalled on a slow reader instead of polling it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from streamd.server.http import common
from streamd.server.http.common import KEEPALIVE, Keepalive

INTERVAL_S = 0.02


def _body(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def test_silence_gets_keepalives_and_the_end_stops_them() -> None:
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        sent.append(message.get("body", b"head"))

    keeper = Keepalive(send, INTERVAL_S)
    await keeper.send({"type": "http.response.start", "status": 200, "headers": []})
    await asyncio.sleep(INTERVAL_S * 6)
    await keeper.send(_body(b"data: x\n\n", more=False))
    count = sent.count(KEEPALIVE)
    await asyncio.sleep(INTERVAL_S * 4)
    keeper.stop()
    assert sent[0] == b"head" and sent[-1] == b"data: x\n\n", sent
    assert 2 <= count == sent.count(KEEPALIVE), sent  # some in the silence, none after the last write


async def test_a_stalled_write_is_waited_for_not_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body write blocked (a slow reader: the server's send awaits its drain) for many intervals: the timer
    wakes a few times, not once per event-loop turn, and writes nothing while the write is under way."""
    calls = 0

    def monotonic() -> float:
        nonlocal calls
        calls += 1
        return time.monotonic()

    monkeypatch.setattr(common, "time", SimpleNamespace(monotonic=monotonic))
    unblock = asyncio.Event()
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        if message.get("body") == b"stalled":
            await unblock.wait()
        sent.append(message.get("body", b"head"))

    keeper = Keepalive(send, INTERVAL_S)
    await keeper.send({"type": "http.response.start", "status": 200, "headers": []})
    writer = asyncio.ensure_future(keeper.send(_body(b"stalled")))
    await asyncio.sleep(INTERVAL_S * 2)
    before = calls
    await asyncio.sleep(INTERVAL_S * 15)  # the write stays stalled all along
    polled = calls - before
    unblock.set()
    await writer
    keeper.stop()
    assert polled < 10, f"the keepalive timer read the clock {polled} times while one write was stalled"
    assert KEEPALIVE not in sent[sent.index(b"stalled") :], sent


async def test_a_body_write_waits_for_a_comment_being_written() -> None:
    """The timer's comment is stalled (a slow reader) when the body writes: the body's bytes go after the
    comment's, never inside it (no lock on the body's path: it waits on the comment's write)."""
    release = asyncio.Event()
    started: list[bytes] = []
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        body = message.get("body", b"head")
        started.append(body)
        if body == KEEPALIVE:
            await release.wait()
        sent.append(body)

    keeper = Keepalive(send, INTERVAL_S)
    await keeper.send({"type": "http.response.start", "status": 200, "headers": []})
    while KEEPALIVE not in started:
        await asyncio.sleep(INTERVAL_S)
    writer = asyncio.ensure_future(keeper.send(_body(b"data: y\n\n", more=False)))
    await asyncio.sleep(INTERVAL_S * 3)
    assert started[-1] == KEEPALIVE, started  # the body has not started writing
    release.set()
    await writer
    keeper.stop()
    assert sent == [b"head", KEEPALIVE, b"data: y\n\n"], sent
