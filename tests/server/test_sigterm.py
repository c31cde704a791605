"""SIGTERM on a real `streamd serve` process: /ready turns 503, streams that can finish within
drain_timeout_s finish, the rest are cancelled, every stream gets its done, sockets close 1001, exit 0."""

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

DRAIN_S = 4.0
SERVE = [sys.executable, "-m", "streamd.cli", "serve", "--host", "127.0.0.1", "--port", "0",
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


@pytest.mark.slow
async def test_sigterm_drains_and_exits_zero() -> None:
    env = {**os.environ, "STREAMD_LOG_FORMAT": "json"}
    proc = await asyncio.create_subprocess_exec(*SERVE, stderr=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.DEVNULL, env=env)
    assert proc.stderr is not None
    log = LogWatcher(proc.stderr)
    try:
        port = (await log.wait_for("listening", 180))["port"]
        await log.wait_for("ready", 180)
        base = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as http, \
                connect(f"ws://127.0.0.1:{port}/v1/stream", subprotocols=["streamd.v1"]) as ws:
            assert (await http.get("/ready")).status_code == 200
            await ws.send(json.dumps({"type": "generate", "id": "short", "prompt": "Hi",
                                      "params": {"max_tokens": 3, "ignore_eos": True}}))
            await ws.send(json.dumps({"type": "generate", "id": "long", "prompt": "Hi",
                                      "params": {"max_tokens": 4000, "ignore_eos": True}}))
            sse_started = asyncio.Event()
            sse = asyncio.create_task(sse_stream(base, sse_started))
            seen: list[dict[str, Any]] = []
            while not any(f["type"] == "delta" and f["id"] == "long" for f in seen):
                seen.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            await asyncio.wait_for(sse_started.wait(), 120)
            proc.send_signal(signal.SIGTERM)
            await log.wait_for("drain_started", 30)
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json()["status"] == "draining"
            async with httpx.AsyncClient(base_url=base) as late:
                refused = await late.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            rest, code = await asyncio.wait_for(read_until_closed(ws), 60)
            sse_items = await asyncio.wait_for(sse, 60)
        frames = seen + rest
        done = {f["id"]: f["finish_reason"] for f in frames if f["type"] == "done"}
        assert done == {"short": "length", "long": "cancelled"}
        assert code == 1001
        assert sse_items[-1] == "[DONE]" and sse_items[-2]["choices"][0]["finish_reason"] == "length"
        assert sse_items[-2]["choices"][0]["streamd_drained"] is True
        assert await asyncio.wait_for(proc.wait(), 60) == 0, log.tail()
        assert any(e.get("event") == "drain_finished" for e in log.events)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
