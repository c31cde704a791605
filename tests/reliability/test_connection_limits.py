"""Issue 35 D4 against a live server: sockets that never send their head, trickle it or never finish their
body are answered 408 and closed; the open sockets (HTTP and WebSocket together) are capped in all and per
client address with a 503 that names the limit; the body bytes in transit are bounded. Through all of it a
control stream gets its reference tokens; after it the pool is whole and no socket or descriptor is left
(fixture). Client addresses other than 127.0.0.1 are loopback aliases (127.0.0.0/8 is all loopback)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import pytest_asyncio
from websockets.exceptions import InvalidStatus

from streamd.engine.client.async_engine import AsyncEngine
from streamd.server.connections import ConnectionGate
from tests.reliability.test_reproductions import CONTROL, reference_tokens
from tests.reliability.util import LIMITS, fd_count, read_answer, read_to_close
from tests.server.util import Server, gather_until_done, running_server, send, ws_connect

CAPS: dict[str, Any] = {
    "max_open_connections": 12, "max_connections_per_client": 6, "header_timeout_s": 1.0, "body_timeout_s": 1.0,
    "keep_alive_timeout_s": 1, "max_pending_body_bytes": 80_000,
}
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def lserver(async_engine: AsyncEngine) -> AsyncIterator[Server]:
    async with running_server(async_engine, **{**LIMITS, **CAPS}) as srv:
        yield srv


def gate_of(server: Server) -> ConnectionGate:
    return server.uvicorn.config.http_protocol_class.gate  # type: ignore[union-attr, no-any-return]


async def open_from(server: Server, client: str) -> Streams:
    return await asyncio.open_connection("127.0.0.1", server.port, local_addr=(client, 0))


async def close(streams: Streams) -> None:
    streams[1].close()
    await asyncio.gather(streams[1].wait_closed(), return_exceptions=True)


@asynccontextmanager
async def controlled(server: Server) -> AsyncIterator[None]:
    """Runs a control stream while the caller abuses the server; checks its tokens at the end."""
    expected = await reference_tokens(server)
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ctl", **CONTROL)
        yield
        assert (await gather_until_done(ws, {"ctl"}))["ctl"].token_ids == expected


async def trickle(writer: asyncio.StreamWriter, data: bytes) -> None:
    """Sends `data` a byte every 0.2 s (a slow-loris client) until the server closes the socket."""
    for byte in data:
        if writer.is_closing():
            return
        writer.write(bytes([byte]))
        await asyncio.sleep(0.2)  # the client's pace, not a wait for the server


def assert_timeout(answer: bytes, phase: str) -> None:
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b'"request_timeout"' in answer and f"server.{phase}_timeout_s".encode() in answer, answer


async def test_silent_partial_and_trickled_heads_are_answered_408_and_closed(lserver: Server) -> None:
    async with controlled(lserver):
        silent = await open_from(lserver, "127.0.0.2")
        partial = await open_from(lserver, "127.0.0.2")
        partial[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        slow = await open_from(lserver, "127.0.0.2")
        pacing = asyncio.create_task(trickle(slow[1], b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X: y\r\n" * 99))
        started = time.monotonic()
        for reader, _ in (silent, partial, slow):
            assert_timeout(await read_to_close(reader), "header")
        assert time.monotonic() - started < 20  # the deadline counts from the first byte, whatever trickles
        pacing.cancel()
        for streams in (silent, partial, slow):
            await close(streams)


async def test_a_body_shorter_than_its_content_length_is_answered_408(lserver: Server) -> None:
    async with controlled(lserver):
        reader, writer = await open_from(lserver, "127.0.0.2")
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
        assert_timeout(await read_to_close(reader), "body")
        await close((reader, writer))
    assert gate_of(lserver).pending_body_bytes == 0


async def wait_open(gate: ConnectionGate, count: int) -> None:
    deadline = time.monotonic() + 30
    while gate.num_open != count:
        assert time.monotonic() < deadline, f"{gate.num_open} sockets open, expected {count}"
        await asyncio.sleep(0.01)


async def test_sockets_are_capped_per_client_and_in_all_websockets_included(lserver: Server) -> None:
    gate = gate_of(lserver)
    held = []
    try:
        for client in ["127.0.0.2"] * 6 + ["127.0.0.3"] * 6:  # 6 per client, 12 in all: every place taken
            held.append(await ws_connect(lserver, local_addr=(client, 0)).__aenter__())
        await wait_open(gate, 12)
        with pytest.raises(InvalidStatus) as refused:
            await ws_connect(lserver, local_addr=("127.0.0.4", 0)).__aenter__()
        assert refused.value.response.status_code == 503 and refused.value.response.headers["Retry-After"] == "1"
        assert b"connections open" in refused.value.response.body
        await held.pop().close()  # one place free in all, none for 127.0.0.2
        await wait_open(gate, 11)
        reader, writer = await open_from(lserver, "127.0.0.2")
        answer = await read_answer(reader)
        assert answer.status == 503 and answer.json()["error"]["code"] == "overloaded", answer
        assert answer.headers["retry-after"] == "1" and answer.headers["connection"] == "close", answer
        assert "server.max_connections_per_client" in answer.json()["error"]["message"]
        await close((reader, writer))
        reader, writer = await open_from(lserver, "127.0.0.3")  # its place is free again
        writer.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert (await read_answer(reader)).status == 200
        await close((reader, writer))
    finally:
        await asyncio.gather(*(ws.close() for ws in held))
    await wait_open(gate, 0)


async def test_body_bytes_in_transit_are_bounded(async_engine: AsyncEngine) -> None:
    async with running_server(async_engine, **{**LIMITS, **CAPS, "body_timeout_s": 60.0}) as server:
        await bodies_in_transit(server)


async def bodies_in_transit(lserver: Server) -> None:
    gate = gate_of(lserver)
    body = b'{"prompt": "Hi", "max_tokens": 1}' + b" " * 60_000
    head = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % len(body)
    first = await open_from(lserver, "127.0.0.2")
    first[1].write(head + body[:50_000])
    deadline = time.monotonic() + 30
    while gate.pending_body_bytes < 50_000:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    second = await open_from(lserver, "127.0.0.3")
    second[1].write(head + body[:50_000])  # 100,000 bytes in transit would pass 80,000
    answer = await read_answer(second[0])
    assert answer.status == 503 and "request bodies in transit" in answer.json()["error"]["message"]
    first[1].write(body[50_000:])  # the first one is served
    assert (await read_answer(first[0])).status == 200
    for streams in (first, second):
        await close(streams)
    assert gate.pending_body_bytes == 0


async def test_a_flood_of_silent_sockets_holds_at_most_the_cap(lserver: Server) -> None:
    """Issue 35's 19,990 silent sockets, scaled: 300 from one address and 300 from others cost the server
    at most its cap of descriptors; every one is answered (503 at once, or 408 at the deadline) and closed."""
    gate = gate_of(lserver)
    async with controlled(lserver):
        before = fd_count()
        flood = [await open_from(lserver, f"127.0.1.{i % 100 + 1}" if i % 2 else "127.0.0.2") for i in range(600)]
        assert gate.num_open <= 12
        assert fd_count() - before <= 600 + 12 + 8  # the clients' 600, the server's at most its cap
        answers = await asyncio.gather(*(read_to_close(reader) for reader, _ in flood))
        statuses = {answer[:12] for answer in answers}
        assert statuses <= {b"HTTP/1.1 503", b"HTTP/1.1 408"}, statuses
        assert any(a.startswith(b"HTTP/1.1 503") for a in answers)
        for streams in flood:
            await close(streams)
