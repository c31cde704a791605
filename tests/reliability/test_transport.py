"""Issue 35's transport defects, each against a live server and real sockets: a drain that a client which
stopped reading cannot hold up (D1), replies a client leaves unread bounded on both WebSocket routes
(D5), Responses lanes and `stream_id`s bounded (D6, D14), the Responses socket pausing a slow reader
(D7), responses bound to the key a `bearer.` subprotocol authenticated (D8a), a finished stream's tail
resumable after its socket died (D10), and no traceback for a client that left pipelined requests
unread (D13). Servers are made per test (their limits are small); each test ends with the engine idle,
its pool whole, the server holding no connection and no file descriptor leaked."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamd.engine.client.async_engine import AsyncEngine
from streamd.server import lifecycle
from tests.reliability.util import fd_count, post_bytes, settle
from tests.server.util import Server, gather_until_done, recv, running_server, send, tiny_socket, ws_connect

DEADLINE_S = 60.0
# A big event per token (20 logprobs) fills a stalled socket's buffers within a few dozen tokens.
LONG = {"prompt": "Count from 1 to 1000, separated by commas:",
        "params": {"n": 4, "logprobs": 20, "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}}


async def until(condition: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> None:
    """Polls `condition` (sync or async) until true; fails naming `what` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def live_server(engine: AsyncEngine, **limits: Any) -> AsyncIterator[Server]:
    """A server with `limits`; on the way out: engine idle, pool whole, no connection, no fd leaked."""
    before = fd_count()
    async with running_server(engine, max_requests_per_connection=8, **limits) as server:
        yield server
        await settle(server)
    stats = await engine.wait_idle(timeout=120)
    assert stats.kv.blocks_free == stats.kv.blocks_total, f"KV blocks leaked: {stats}"
    assert fd_count() <= before, "file descriptors leaked"


async def stalled(server: Server, path: str = "/v1/stream", **kwargs: Any) -> Any:
    """A WebSocket client that buffers at most one message and has a tiny receive buffer: once the test
    stops calling recv, the server's writes back up."""
    kwargs.setdefault("subprotocols", ["streamd.v1"] if path == "/v1/stream" else None)
    return await connect(f"ws://127.0.0.1:{server.port}{path}", sock=await tiny_socket(server), max_queue=1,
                         max_size=None, open_timeout=30, ping_interval=None, **kwargs)


def closes(server: Server, code: str) -> float:
    return server.services.metrics.ws_closes.labels(code)._value.get()


def num_paused(engine: AsyncEngine) -> Awaitable[int]:
    return engine.call(lambda e: e.stats().scheduler.num_paused)


# ---- D5: replies a client leaves unread ---------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/stream", "/v1/responses"])
async def test_unread_replies_are_bounded_then_closed_1008(async_engine: AsyncEngine, path: str) -> None:
    async with live_server(async_engine, max_queued_frames=64, ws_close_timeout_s=1.0,
                           socket_send_buffer_bytes=4096) as server:
        before = closes(server, "1008")
        ws = await stalled(server, path)
        try:
            for _ in range(5000):  # tiny invalid frames (~70 bytes of error reply each), replies never read
                await ws.send("x")
        except ConnectionClosed:
            pass
        await until(lambda: closes(server, "1008") > before, "the 1008 close")
        await until(lambda: not server.uvicorn.server_state.connections, "the stalled socket to be dropped")
        ws.transport.abort()
        async with ws_connect(server) as other:  # the server serves on
            await send(other, type="generate", id="a", prompt="Hi", params={"max_tokens": 2})
            assert (await gather_until_done(other, {"a"}))["a"].done["finish_reason"] == "length"


def create(**fields: Any) -> str:
    return json.dumps({"type": "response.create", **fields})


async def events_until_end(ws: Any) -> list[dict[str, Any]]:
    """A Responses socket's events up to a terminal one (or an error event)."""
    events: list[dict[str, Any]] = []
    while not events or events[-1]["type"] not in ("response.completed", "response.incomplete",
                                                   "response.failed", "error"):
        events.append(json.loads(await asyncio.wait_for(ws.recv(), DEADLINE_S)))
    return events


# ---- D1: a drain that stalled readers cannot hold up ------------------------------------------------
async def test_drain_ends_while_clients_stopped_reading(async_engine: AsyncEngine,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "CANCEL_GRACE_S", 1.0)
    async with live_server(async_engine, drain_timeout_s=0.5, ws_close_timeout_s=1.0, max_unsent_tokens=16,
                           socket_send_buffer_bytes=4096) as server:
        stream = await stalled(server)
        await send(stream, type="generate", id="s", **LONG)
        assert (await recv(stream))["type"] == "start"  # from here on nothing is read
        responses = await stalled(server, "/v1/responses")
        await responses.send(create(input=LONG["prompt"], max_output_tokens=400, top_logprobs=20, temperature=0))
        await until(lambda: num_paused(async_engine), "a stalled reader's request to pause")
        started = time.monotonic()
        await asyncio.wait_for(server.services.lifecycle.drain(), 30)  # 0.5 + grace 1 + close 1, and slack
        took = time.monotonic() - started
        await until(lambda: not server.uvicorn.server_state.connections, "the stalled sockets to be dropped")
        for ws in (stream, responses):
            ws.transport.abort()
    assert took < 20, took


# ---- D7: the Responses socket pauses a slow reader --------------------------------------------------
async def test_responses_socket_pauses_a_slow_reader(async_engine: AsyncEngine) -> None:
    # No server pings: this client reads nothing until the pause, and on a loaded box that took over the
    # ping interval plus its timeout (40 s), after which the server dropped it (one full-suite run)
    async with live_server(async_engine, max_unsent_tokens=2, socket_send_buffer_bytes=4096,
                           ws_ping_interval_s=0) as server:
        ws = await stalled(server, "/v1/responses")
        await ws.send(create(input=LONG["prompt"], max_output_tokens=120, top_logprobs=20, temperature=0))

        deadline, seen_running = time.monotonic() + DEADLINE_S, False
        while True:
            paused, live = await async_engine.call(lambda e: (e.stats().scheduler.num_paused, e.stats().num_requests))
            if paused:
                break
            assert not (seen_running and live == 0), "the slow reader's response ran to its end, never paused"
            seen_running = seen_running or live == 1
            assert time.monotonic() < deadline, "the response was never paused"
            await asyncio.sleep(0.01)
        events = await events_until_end(ws)  # reading again: it resumes and ends whole
        await ws.close()
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert "".join(deltas) == done["text"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]


# ---- D6, D14: stream ids and lanes bounded ----------------------------------------------------------
async def test_stream_ids_are_bounded_and_idle_lanes_forgotten(async_engine: AsyncEngine) -> None:
    async with live_server(async_engine) as server:
        async with connect(f"ws://127.0.0.1:{server.port}/v1/responses", open_timeout=30) as ws:
            await ws.send(create(input="Hi", max_output_tokens=1, stream_id="x" * 257))
            (error,) = await events_until_end(ws)
            assert error["error"]["param"] == "stream_id" and "at most 256" in error["error"]["message"]
            assert "stream_id" not in error  # a refused id is not echoed
            for i in range(12):
                await ws.send(create(input="Hi", max_output_tokens=1, stream_id=f"lane-{i}"))
                events = await events_until_end(ws)
                assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
                assert {e["stream_id"] for e in events} == {f"lane-{i}"}
            (connection,) = server.services.lifecycle._closers  # (the open socket's connection)
            await until(lambda: not connection.lanes and not connection.tasks, "idle lanes to be forgotten")


# ---- D8a: responses bound to the key that authenticated the socket ----------------------------------
async def respond(ws: Any, **fields: Any) -> dict[str, Any]:
    await ws.send(create(input="Hi", max_output_tokens=2, **fields))
    return (await events_until_end(ws))[-1]


async def test_responses_are_bound_to_the_subprotocol_key(async_engine: AsyncEngine) -> None:
    async with live_server(async_engine, api_keys=["key-a", "key-b"]) as server:
        url = f"ws://127.0.0.1:{server.port}/v1/responses"
        async with connect(url, subprotocols=["bearer.key-a"], open_timeout=30) as a:
            first = (await respond(a))["response"]["id"]
        async with connect(url, subprotocols=["bearer.key-b"], open_timeout=30) as b:
            refused = await respond(b, previous_response_id=first)
        assert refused["type"] == "error" and refused["error"]["code"] == "previous_response_not_found", refused
        async with connect(url, subprotocols=["bearer.key-a"], open_timeout=30) as a:  # its own key: continues
            assert (await respond(a, previous_response_id=first))["type"] != "error"
        async with httpx.AsyncClient(base_url=server.http, timeout=DEADLINE_S) as http:
            body = {"input": "More", "max_output_tokens": 2, "previous_response_id": first}
            other = await http.post("/v1/responses", json=body, headers={"Authorization": "Bearer key-b"})
            own = await http.post("/v1/responses", json=body, headers={"Authorization": "Bearer key-a"})
        assert other.status_code == 400 and own.status_code == 200, (other.text, own.text)


# ---- D10: a finished stream's tail survives its socket ----------------------------------------------
async def frames_until_end(ws: Any, request_id: str) -> list[dict[str, Any]]:
    """`request_id`'s frames up to its done or an error."""
    frames: list[dict[str, Any]] = []
    while not frames or frames[-1]["type"] not in ("done", "error"):
        frame = await recv(ws, DEADLINE_S)
        if frame.get("id") == request_id:
            frames.append(frame)
    return frames


async def test_a_finished_streams_tail_is_resumable_until_acknowledged(async_engine: AsyncEngine) -> None:
    async with live_server(async_engine, resume_grace_s=30) as server:
        ws = await stalled(server)
        await send(ws, type="generate", id="t", prompt="Hi", params={"max_tokens": 8, "ignore_eos": True})
        start = await recv(ws)  # from here on nothing is read
        token = start["resume_token"]
        await until(lambda: server.services.lifecycle.num_active == 0, "its done to be written")
        ws.transport.abort()  # the connection dies with the tail unread
        async with ws_connect(server) as again:
            await send(again, type="resume", id="t", resume_token=token, after_seq=-1)
            tail = await frames_until_end(again, "t")
            assert tail[-1]["type"] == "done", tail
            deltas = [f for f in tail if f["type"] == "delta"]
            assert [f["seq"] for f in deltas] == list(range(len(deltas)))
            assert sum(len(f["token_ids"]) for f in deltas) == tail[-1]["usage"]["completion_tokens"] == 8
            await send(again, type="ack", id="t", resume_token=token[:-2] + "xx")
            assert (await frames_until_end(again, "t"))[-1]["error"]["code"] == "invalid_resume_token"
            await send(again, type="ack", id="t", resume_token=token)  # acknowledged: released
            await send(again, type="resume", id="t", resume_token=token, after_seq=-1)
            assert (await frames_until_end(again, "t"))[-1]["error"]["code"] == "unknown_id"
        assert not len(server.services.resumes)


# ---- D13: pipelined requests a client left unread ---------------------------------------------------
async def test_unread_pipelined_requests_log_no_traceback(async_engine: AsyncEngine,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    async with live_server(async_engine) as server:
        with caplog.at_level(logging.DEBUG):
            for path, stream in [("/v1/completions", False), ("/v1/completions", True), ("/v1/responses", True)]:
                field = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
                body = json.dumps({"prompt" if "compl" in path else "input": "Hi", field: 6, "stream": stream})
                _, writer = await asyncio.open_connection("127.0.0.1", server.port)
                writer.write(post_bytes(path, body.encode()) * 4 + post_bytes(path, body[:5].encode()))
                await writer.drain()
                await until(lambda: server.services.lifecycle.num_active, "the first request to start")
                writer.close()  # gone, every answer unread
                await until(lambda: not server.services.lifecycle.num_active, "its requests to end")
            await settle(server)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


async def test_pipelined_streams_learn_their_client_left(async_engine: AsyncEngine) -> None:
    """uvicorn told only the newest pipelined request of a lost connection: an earlier, running stream
    generated on (or, paused, held its blocks until the server stopped)."""
    async with live_server(async_engine, max_unsent_tokens=16, socket_send_buffer_bytes=4096) as server:
        body = json.dumps({"prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "n": 4, "logprobs": 5,
                           "stream": True}).encode()
        sock = await tiny_socket(server)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sock, post_bytes("/v1/completions", body) * 3)
        await until(lambda: server.services.lifecycle.num_active, "the first stream to start")
        sock.close()  # gone with every answer unread
        await until(lambda: not server.services.lifecycle.num_active, "the stream to learn its client left", 30)
