"""Storms against a live server: disconnects (clean closes, TCP resets, killed client processes), cancel
storms, a client that never reads, and preemption under load with cancels on a tiny KV pool. Through all
of it a control stream gets exactly its reference tokens; after it the pool is whole and every connection
and file descriptor is gone (fixture)."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import sys
from typing import Any

import httpx
import pytest

from tests.helpers import sizes
from tests.reliability.test_reproductions import CONTROL, reference_tokens
from tests.reliability.util import upgrade_bytes
from tests.server.util import Result, Server, check_stream, gather_until_done, recv_frames, send, ws_connect

LONG = {"max_tokens": 16, "ignore_eos": True}


def reset(ws: Any) -> None:
    """Closes the client's socket with a TCP RST (SO_LINGER 0), as a crashed client or a middlebox would."""
    sock = ws.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def control_run(server: Server, expected: list[int], started: asyncio.Event) -> None:
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ctl", **CONTROL)
        started.set()
        result = (await gather_until_done(ws, {"ctl"}))["ctl"]
    check_stream(result)
    assert result.token_ids == expected


async def storm_client(server: Server, index: int) -> None:
    """Eight streams, then one of: cancel them all, reset the socket, close it, or vanish mid-handshake."""
    how = index % 4
    async with ws_connect(server) as ws:
        ids = {f"s{index}-{i}" for i in range(8)}
        for request_id in sorted(ids):
            await send(ws, type="generate", id=request_id, prompt=f"Story {index}", params=LONG)
        await recv_frames(ws)  # something is running
        if how == 0:
            for request_id in sorted(ids):
                await send(ws, type="cancel", id=request_id)
            results = await gather_until_done(ws, ids)
            assert {r.done["finish_reason"] for r in results.values()} <= {"cancelled", "length"}
        elif how == 1:
            reset(ws)
        elif how == 2:
            await ws.close()
        else:
            reset(ws)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(upgrade_bytes([])[:40])  # half a handshake, then gone
            writer.close()
            await writer.wait_closed()


async def sse_dropped(server: Server) -> None:
    body = {"prompt": "Once upon", "max_tokens": 16, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server.http, timeout=120) as http, \
            http.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break  # leave mid-stream


async def test_disconnect_and_cancel_storm(rserver: Server) -> None:
    expected = await reference_tokens(rserver)
    started = asyncio.Event()
    control = asyncio.create_task(control_run(rserver, expected, started))
    await started.wait()
    await asyncio.gather(*(storm_client(rserver, i) for i in range(8)), *(sse_dropped(rserver) for _ in range(4)))
    await control


CLIENT = """
import json, sys
from websockets.sync.client import connect
ws = connect(sys.argv[1], subprotocols=["streamd.v1"])
for i in range(6):
    ws.send(json.dumps({"type": "generate", "id": str(i), "prompt": "Tell me", "params": {"max_tokens": 200, "ignore_eos": True}}))
while json.loads(ws.recv())["type"] != "delta":
    pass
print("streaming", flush=True)
sys.stdin.read()
"""


async def test_killed_client_processes(rserver: Server) -> None:
    procs = [await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT, rserver.ws,
                                                  stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
             for _ in range(3)]
    for proc in procs:
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 120)).strip() == b"streaming"
    for proc in procs:
        proc.kill()
        await proc.wait()
    # The server sees three sockets closed by the kernel: it must abort their 18 streams (pool whole,
    # checked by the fixture) and close the connections.


async def test_non_reading_client_does_not_stall_others(rserver: Server) -> None:
    expected = await reference_tokens(rserver)
    reader, writer = await asyncio.open_connection("127.0.0.1", rserver.port)
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    writer.write(upgrade_bytes([]))
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101")
    for i in range(8):  # big frames (20 logprobs each), never read
        writer.write(_masked_text(json.dumps({"type": "generate", "id": str(i), "prompt": "List numbers",
                                              "params": {"max_tokens": 60, "ignore_eos": True, "logprobs": 20}})))
    started = asyncio.Event()
    await control_run(rserver, expected, started)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


def _masked_text(text: str) -> bytes:
    """One client text frame (RFC 6455: clients mask; a zero mask keeps it simple)."""
    payload = text.encode()
    size = len(payload)
    if size < 126:
        head = struct.pack("!BB", 0x81, 0x80 | size)
    elif size < 1 << 16:
        head = struct.pack("!BBH", 0x81, 0x80 | 126, size)
    else:
        head = struct.pack("!BBQ", 0x81, 0x80 | 127, size)
    return head + b"\0\0\0\0" + payload


# Streams a socket: even with every other one cancelled, 2 x 3 streams of ~53 tokens (4 blocks each) need
# more than the 16-block pool, so they preempt each other; the full size (slow) runs 2 x 8.
@pytest.mark.parametrize("per_socket", sizes(6, 8))
async def test_preemption_under_load_with_cancels(tiny_server: Server, per_socket: int) -> None:
    prompts = ["The history of Rome", "A recipe for bread"]
    params = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
    reference: dict[str, list[int]] = {}
    async with ws_connect(tiny_server) as ws:
        for i, prompt in enumerate(prompts):
            await send(ws, type="generate", id=f"ref{i}", prompt=prompt, params=params)
            reference[prompt] = (await gather_until_done(ws, {f"ref{i}"}))[f"ref{i}"].token_ids
    before = _preemptions(tiny_server)
    async with ws_connect(tiny_server) as a, ws_connect(tiny_server) as b:
        sockets = {"a": a, "b": b}
        for name, ws in sockets.items():
            for i in range(per_socket):
                await send(ws, type="generate", id=f"{name}{i}", prompt=prompts[i % 2], params=params)
        results: dict[str, dict[str, Result]] = {name: {} for name in sockets}
        for name, ws in sockets.items():  # cancel every other stream once it has started
            for i in range(1, per_socket, 2):
                await send(ws, type="cancel", id=f"{name}{i}")
        done = await asyncio.gather(*(gather_until_done(ws, {f"{n}{i}" for i in range(per_socket)}, results[n])
                                      for n, ws in sockets.items()))
    for name, socket_results in zip(sockets, done):
        for i in range(per_socket):
            result = socket_results[f"{name}{i}"]
            if result.of("error"):
                continue  # refused (the connection or pool was full): answered, nothing to compare
            check_stream(result)
            if result.done["finish_reason"] == "length":
                assert result.token_ids == reference[prompts[i % 2]], f"{name}{i}"
            else:
                assert i % 2 == 1 and result.done["finish_reason"] == "cancelled"
                assert result.token_ids == reference[prompts[i % 2]][:len(result.token_ids)]
    assert _preemptions(tiny_server) > before, "the tiny pool should have forced preemptions"


def _preemptions(server: Server) -> int:
    scheduler = server.services.engine.stats().scheduler
    return scheduler.preemptions_swap + scheduler.preemptions_recompute
