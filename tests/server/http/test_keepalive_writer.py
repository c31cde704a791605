"""`http.common.Keepalive` on its own (no server, no proxy: test_keepalive.py has those): it writes `: keepalive`
only into silence, stops with the body, and waits for a write stalled on a slow reader instead of polling it."""

from __future__ import annotations

import asyncio
from typing import Any

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


async def test_a_stalled_write_is_waited_for_not_polled() -> None:
    """A body write blocked (a slow reader: the server's send awaits its drain) for many intervals: the timer
    wakes twice an interval, not once per event-loop turn, and writes nothing while the write is under way."""
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
    before = keeper.wakes
    await asyncio.sleep(INTERVAL_S * 15)  # the write stays stalled all along
    polled = keeper.wakes - before
    unblock.set()
    await writer
    keeper.stop()
    assert 0 < polled <= 40, f"the keepalive timer woke {polled} times in 15 intervals of one stalled write"
    assert KEEPALIVE not in sent[sent.index(b"stalled") :], sent


async def test_a_comment_comes_within_one_interval_of_silence_and_none_while_chunks_flow() -> None:
    """Chunks every fifth of an interval for three intervals: no comment between them; then silence: the
    first comment after half an interval at the earliest and within one (plus the event loop's slack, generous
    for a loaded CI machine)."""
    interval = INTERVAL_S * 10
    sent: list[tuple[float, bytes]] = []
    loop = asyncio.get_running_loop()

    async def send(message: Any) -> None:
        sent.append((loop.time(), message.get("body", b"head")))

    keeper = Keepalive(send, interval)
    await keeper.send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(15):
        await keeper.send(_body(b"data: z\n\n"))
        await asyncio.sleep(interval / 5)
    while sent[-1][1] != KEEPALIVE:
        await asyncio.sleep(INTERVAL_S)
    keeper.stop()
    last_data = max(t for t, body in sent if body.startswith(b"data"))
    comments = [t for t, body in sent if body == KEEPALIVE]
    assert len(comments) == 1 and comments[0] > last_data, sent  # none while the chunks flowed
    assert interval / 2 <= comments[0] - last_data < interval + 0.5, sent


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


async def test_a_writer_cancelled_while_waiting_for_a_comment_leaves_the_timer_running() -> None:
    """The disconnect watch (or a drain) cancels a body write that waits for the timer's comment: the comment's
    future is shielded, so the timer finishes its write and keeps running (unshielded, the cancelled future made
    its `set_result` raise and the timer task died)."""
    release = asyncio.Event()
    sent: list[bytes] = []

    async def send(message: Any) -> None:
        body = message.get("body", b"head")
        if body == KEEPALIVE and KEEPALIVE not in sent:
            await release.wait()
        sent.append(body)

    keeper = Keepalive(send, INTERVAL_S)
    await keeper.send({"type": "http.response.start", "status": 200, "headers": []})
    while keeper.comment is None:
        await asyncio.sleep(INTERVAL_S / 2)
    writer = asyncio.ensure_future(keeper.send(_body(b"data: w\n\n")))
    await asyncio.sleep(INTERVAL_S)
    writer.cancel()
    await asyncio.gather(writer, return_exceptions=True)
    release.set()
    while sent.count(KEEPALIVE) < 2:  # the timer lives on: its next comment comes
        assert keeper._timer is not None and not keeper._timer.done(), keeper._timer
        await asyncio.sleep(INTERVAL_S / 2)
    keeper.stop()
    assert keeper.comment is None and b"data: w\n\n" not in sent, sent
