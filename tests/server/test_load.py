"""Concurrent WebSocket clients on the CPU model (50 in `make test`, 200 in the slow full size): every token
delivered, no block leaked."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers import sizes
from tests.server.util import Server, check_stream, gather_until_done, send, ws_connect

MAX_TOKENS = 4


async def one_client(server: Server, i: int, connected: asyncio.Barrier) -> None:
    async with ws_connect(server) as ws:
        await connected.wait()  # every socket is open before anyone asks: truly concurrent
        await send(ws, type="generate", id=f"c{i}", prompt=f"Client {i} says:",
                   params={"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0})
        result = (await gather_until_done(ws, {f"c{i}"}, timeout=300))[f"c{i}"]
    check_stream(result)
    assert result.done["finish_reason"] == "length"
    assert len(result.token_ids) == MAX_TOKENS


@pytest.mark.parametrize("clients", sizes(50, 200))
async def test_concurrent_websocket_clients(server: Server, async_engine, clients: int) -> None:
    connected = asyncio.Barrier(clients)
    await asyncio.wait_for(asyncio.gather(*(one_client(server, i, connected) for i in range(clients))), 600)
    stats = await async_engine.wait_idle()
    assert stats.kv.blocks_free == stats.kv.blocks_total
    assert server.services.lifecycle.num_active == 0
