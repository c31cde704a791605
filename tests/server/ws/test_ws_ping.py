"""`server.ws_ping_interval_s`: the server pings every WebSocket that often, what keeps a proxy's idle timeout
(nginx `proxy_read_timeout`) from cutting `/v1/stream` while a long prefill sends nothing; 0: never. Read
off a raw socket after the handshake: a ping is a frame whose first byte is 0x89 (FIN + opcode 9)."""

from __future__ import annotations

import asyncio
import base64
import os
import time

import pytest

from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import running_server

PING = 0x89


async def _first_frame_byte(port: int, wait_s: float) -> int | None:
    """Opens `/v1/stream` by hand and returns the first byte of the first frame the server sends within
    `wait_s` (None if none: the client never sends anything after the handshake)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write((f"GET /v1/stream HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                  f"Sec-WebSocket-Protocol: streamd.v1\r\n\r\n").encode())
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 101"), head
        deadline = time.monotonic() + wait_s
        try:
            first = await asyncio.wait_for(reader.readexactly(1), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return None
        return first[0]
    finally:
        writer.close()


@pytest.mark.parametrize(("interval_s", "expected"), [(0.2, PING), (0.0, None)])
async def test_the_server_pings_an_idle_websocket(async_engine: AsyncEngine, interval_s: float,
                                                  expected: int | None) -> None:
    async with running_server(async_engine, ws_ping_interval_s=interval_s) as srv:
        assert await _first_frame_byte(srv.port, wait_s=3.0) == expected
