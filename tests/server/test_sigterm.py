"""SIGTERM on a real `streamd serve` process: /ready turns 503, streams that can finish within
drain_timeout_s finish, the rest are cancelled (their `done` says `drained`), every one of the resumable
WebSocket streams (five a socket: two sockets in `make test`, four in the slow full size) and an SSE stream
gets its end, sockets close 1012 (service restart: reconnect
elsewhere), exit 0; a resume token of the old process is refused by a new server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamd.engine.client.async_engine import AsyncEngine
from tests.helpers import sizes
from tests.server.util import recv, running_server, send, ws_connect

DRAIN_S = 4.0
SERVE = [sys.executable, "-m", "streamd.cli.main", "serve", "--host", "127.0.0.1", "--port", "0",
         "--set", "model.device=cpu", "--set", "model.dtype=float32", "--set", "cache.num_kv_blocks=256",
         "--set", "cache.num_swap_blocks=0", "--set", f"server.drain_timeout_s={DRAIN_S}"]


class LogWatcher:
    """Reads the server's JSON log lines; tests wait for events by name (on a condition, not a timer)."""

    def __init__(self, stderr: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self.events: list[dict[str, Any]] = []
        self.closed = False
        self._changed = asyncio.Condition()
        self._task = asyncio.create_task(self._read(stderr))

    async def _read(self, stderr: asyncio.StreamReader) -> None:
        while line := (await stderr.readline()).decode(errors="replace"):
            self.lines.append(line)
            if line.startswith("{"):
                self.events.append(json.loads(line))
            async with self._changed:
                self._changed.notify_all()
        self.closed = True
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, name: str, timeout: float) -> dict[str, Any]:
        def found() -> bool:
            return self.closed or any(e.get("event") == name for e in self.events)

        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(found)
        for event in self.events:
            if event.get("event") == name:
                return event
        raise AssertionError(f"server exited before {name!r}:\n{self.tail()}")

    def tail(self) -> str:
        return "".join(self.lines[-40:])


async def read_until_closed(ws: Any) -> tuple[list[dict[str, Any]], int | None]:
    frames = []
    try:
        while True:
            frames.append(json.loads(await ws.recv()))
    except ConnectionClosed as closed:
        return frames, closed.rcvd.code if closed.rcvd else None


async def sse_stream(base: str, started: asyncio.Event) -> list[dict[str, Any] | str]:
    """A long streamed chat completion; sets `started` at its first token, returns every data item."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4000, "ignore_eos": True,
            "stream": True}
    items: list[dict[str, Any] | str] = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as http, \
            http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                items.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                if items[-1] != "[DONE]" and items[-1]["choices"][0]["delta"].get("content"):
                    started.set()
    return items


async def start_server(command: list[str] = SERVE) -> tuple[asyncio.subprocess.Process, LogWatcher, int]:
    env = {**os.environ, "STREAMD_LOG_FORMAT": "json"}
    proc = await asyncio.create_subprocess_exec(*command, stderr=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.DEVNULL, env=env)
    assert proc.stderr is not None
    log = LogWatcher(proc.stderr)
    port = (await log.wait_for("listening", 180))["port"]
    await log.wait_for("ready", 180)
    return proc, log, port


async def start_streams(port: int, num_sockets: int) -> tuple[list[Any], dict[int, list[dict[str, Any]]]]:
    """Sockets with five resumable streams each (the first of each short enough to finish before the drain
    ends, the others not); returns once every stream has its start and a first delta."""
    sockets = [await connect(f"ws://127.0.0.1:{port}/v1/stream", subprotocols=["streamd.v1"])
               for _ in range(num_sockets)]
    for c, ws in enumerate(sockets):
        for r in range(5):
            await ws.send(json.dumps({"type": "generate", "id": f"s{c}.{r}", "prompt": "Hi",
                                      "params": {"max_tokens": 3 if r == 0 else 4000, "ignore_eos": True}}))
    seen: dict[int, list[dict[str, Any]]] = {}
    for c, ws in enumerate(sockets):
        seen[c] = []
        while len({f["id"] for f in seen[c] if f["type"] == "delta"}) < 5:
            seen[c].append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
    return sockets, seen


@pytest.mark.parametrize("num_sockets", sizes(2, 4))
async def test_sigterm_drains_and_exits_zero(async_engine: AsyncEngine, num_sockets: int) -> None:
    proc, log, port = await start_server()
    try:
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as http:
            assert (await http.get("/ready")).status_code == 200
            sockets, seen = await start_streams(port, num_sockets)
            sse_started = asyncio.Event()
            sse = asyncio.create_task(sse_stream(base, sse_started))
            await asyncio.wait_for(sse_started.wait(), 120)
            proc.send_signal(signal.SIGTERM)
            await log.wait_for("drain_started", 30)
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            async with httpx.AsyncClient(base_url=base) as late:
                refused = await late.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            closes = await asyncio.wait_for(asyncio.gather(*(read_until_closed(ws) for ws in sockets)), 60)
            sse_items = await asyncio.wait_for(sse, 60)
        assert sse_items[-1] == "[DONE]" and sse_items[-2]["choices"][0]["finish_reason"] == "length"
        assert sse_items[-2]["choices"][0]["streamd_drained"] is True
        assert await asyncio.wait_for(proc.wait(), 60) == 0, log.tail()
        assert any(e.get("event") == "drain_finished" for e in log.events)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    tokens = {}
    for c, (rest, code) in enumerate(closes):
        assert code == 1012  # service restart: reconnect elsewhere
        frames = seen[c] + rest
        for r in range(5):
            mine = [f for f in frames if f["id"] == f"s{c}.{r}"]
            tokens[f"s{c}.{r}"] = mine[0]["resume_token"]
            (done,) = [f for f in mine if f["type"] == "done"]  # the drain delivers every done before closing
            expected = ("length", None) if r == 0 else ("cancelled", True)  # cut by the drain: it says so
            assert (done["finish_reason"], done.get("drained")) == expected
    async with running_server(async_engine) as server, ws_connect(server) as ws:  # the old process is gone
        await send(ws, type="resume", id="s0.1", resume_token=tokens["s0.1"], after_seq=0)
        refused_resume = await recv(ws)
    assert refused_resume["type"] == "error" and refused_resume["error"]["code"] == "invalid_resume_token"
