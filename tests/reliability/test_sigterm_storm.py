"""SIGTERM on a real `streamd serve` process holding many streams, then a second signal while it drains:
the first turns /ready 503 and refuses new work while the streams keep going; the second ends the drain
at once: every socket is closed, every stream that got a `done` got exactly one, and the process exits
promptly (uvicorn's forced shutdown re-raises the signal: exit code 0 or -SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import connect

from tests.helpers import sizes
from tests.server.test_sigterm import SERVE, LogWatcher, read_until_closed

EXIT_BOUND_S = 30.0


@pytest.mark.parametrize("shape", sizes((2, 3), (4, 5)))  # (sockets, streams per socket)
async def test_sigterm_with_many_streams_and_a_second_signal(shape: tuple[int, int]) -> None:
    num_sockets, streams_per_socket = shape
    env = {**os.environ, "STREAMD_LOG_FORMAT": "json"}
    serve = [*SERVE, "--set", "server.drain_timeout_s=120"]  # the later --set wins: only the 2nd signal ends it
    proc = await asyncio.create_subprocess_exec(*serve, stderr=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.DEVNULL, env=env)
    assert proc.stderr is not None
    log = LogWatcher(proc.stderr)
    try:
        port = (await log.wait_for("listening", 180))["port"]
        await log.wait_for("ready", 180)
        sockets = [await connect(f"ws://127.0.0.1:{port}/v1/stream", subprotocols=["streamd.v1"])
                   for _ in range(num_sockets)]
        for s, ws in enumerate(sockets):
            for i in range(streams_per_socket):
                await ws.send(json.dumps({"type": "generate", "id": f"{s}-{i}", "prompt": "Hi",
                                          "params": {"max_tokens": 4000, "ignore_eos": True}}))
        for ws in sockets:  # every socket is streaming
            while json.loads(await asyncio.wait_for(ws.recv(), 120))["type"] != "delta":
                pass
        proc.send_signal(signal.SIGTERM)
        await log.wait_for("drain_started", 30)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert (await http.get("/ready")).status_code == 503
        second = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        closed = await asyncio.wait_for(asyncio.gather(*(read_until_closed(ws) for ws in sockets)), EXIT_BOUND_S)
        code = await asyncio.wait_for(proc.wait(), EXIT_BOUND_S)
        assert time.monotonic() - second < EXIT_BOUND_S
        assert code in (0, -signal.SIGTERM), log.tail()
        for frames, _ in closed:
            _one_done_at_most(frames)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _one_done_at_most(frames: list[dict[str, Any]]) -> None:
    dones = [f["id"] for f in frames if f["type"] == "done"]
    assert len(dones) == len(set(dones)), dones
