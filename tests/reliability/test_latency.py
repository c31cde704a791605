"""Event-loop latency probe: while the largest inputs the server takes (a prompt of `max_prompt_chars`
over HTTP and a near-`max_frame_bytes` prompt over WebSocket) are tokenized, the event loop keeps
turning and another stream keeps receiving tokens."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from streamd.config import ServerConfig
from tests.server.util import Server, recv_frames, running_server, send, ws_connect

STALL_BOUND_S = 1.0  # tokenizing 1M characters takes seconds on one core: on the loop it would stall that long
TICK_S = 0.01


async def loop_lag(stop: asyncio.Event) -> float:
    """The longest the loop took beyond a 10 ms sleep while `stop` is unset."""
    worst = 0.0
    while not stop.is_set():
        start = time.monotonic()
        await asyncio.sleep(TICK_S)
        worst = max(worst, time.monotonic() - start - TICK_S)
    return worst


async def test_big_inputs_do_not_stall_other_streams(async_engine) -> None:
    chars = ServerConfig().max_prompt_chars
    async with running_server(async_engine) as srv:
        await _probe(srv, chars)


async def _probe(srv: Server, chars: int) -> None:
    async with ws_connect(srv) as control, ws_connect(srv, max_size=None) as big_ws, \
            httpx.AsyncClient(base_url=srv.http, timeout=120) as http:
        await send(control, type="generate", id="ctl", prompt="Count:", params={"max_tokens": 4000, "ignore_eos": True})
        while not any(f["type"] == "delta" for f in await recv_frames(control)):
            pass
        stop = asyncio.Event()
        lag = asyncio.create_task(loop_lag(stop))
        deltas_during = 0

        async def count_control() -> None:
            """Counts the control stream's deltas until `stop`, then reads on to its done."""
            nonlocal deltas_during
            while True:
                frames = await recv_frames(control)
                if not stop.is_set():
                    deltas_during += sum(f["type"] == "delta" for f in frames)
                if any(f["type"] == "done" for f in frames):
                    return

        counter = asyncio.create_task(count_control())
        frame_prompt = "word " * ((srv.services.config.max_frame_bytes - 200) // 5)
        await big_ws.send(json.dumps({"type": "generate", "id": "big", "prompt": frame_prompt}))
        http_answer = await http.post("/v1/completions", json={"prompt": "word " * (chars // 5), "max_tokens": 1})
        ws_answer = [f for f in await recv_frames(big_ws)][0]
        stop.set()
        worst = await lag
        await send(control, type="cancel", id="ctl")
        await counter
    assert http_answer.status_code == 400 and http_answer.json()["error"]["code"] == "context_length_exceeded"
    assert ws_answer["error"]["code"] == "context_length_exceeded", ws_answer
    assert worst < STALL_BOUND_S, f"the event loop stalled {worst:.2f} s while big inputs were tokenized"
    assert deltas_during > 0, "the control stream got no token while big inputs were tokenized"
