"""A tensor-parallel worker killed mid-generation: the request in flight ends with an error, the engine is
declared dead (`/ready` and `/health` answer 503) within a bounded time, every KV block is free again, and
nothing hangs. The server process stays up, reporting the dead engine, until it is restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx

from streamd import LLM
from streamd.engine.client.async_engine import AsyncEngine
from tests.engine.worker.tp_models import save_random_model
from tests.server.util import recv, running_server, send, ws_connect

DEAD_WITHIN_S = 30.0  # the bound asserted: far above the observed time, far below a hang


async def _wait_status(client: httpx.AsyncClient, url: str, status: int, deadline: float) -> httpx.Response:
    while True:
        response = await client.get(url)
        if response.status_code == status or time.monotonic() > deadline:
            return response
        await asyncio.sleep(0.05)  # polling an observable state with a deadline, not synchronising on time


async def test_killed_worker_fails_the_request_and_ready_turns_503(tmp_path: Path) -> None:
    path = save_random_model("llama", tmp_path / "llama")
    llm = LLM(str(path), tensor_parallel_size=2, device="cpu", dtype="float32", block_size=8, num_kv_blocks=64,
              num_swap_blocks=0, collective_timeout_s=120.0)  # above DEAD_WITHIN_S: death, not a timeout
    executor = llm.engine.executor
    engine = AsyncEngine(llm.engine)
    try:
        async with running_server(engine) as srv, httpx.AsyncClient(base_url=srv.http, timeout=30) as client:
            assert (await client.get("/ready")).status_code == 200
            async with ws_connect(srv) as ws:
                await send(ws, type="generate", id="a", prompt="w1 w2 w3 w4 w5",
                           params={"max_tokens": 200, "ignore_eos": True, "temperature": 0.0})
                assert (await recv(ws))["type"] == "start"
                assert (await recv(ws))["type"] == "delta"
                os.kill(executor.workers.processes[0].pid, signal.SIGKILL)
                killed = time.monotonic()
                frames = [await recv(ws, timeout=DEAD_WITHIN_S)]
                while frames[-1]["type"] != "done":
                    frames.append(await recv(ws, timeout=DEAD_WITHIN_S))
            assert frames[-1]["finish_reason"] == "error", frames[-1]
            errors = [f for f in frames if f["type"] == "error"]
            assert errors and "tensor-parallel" in errors[0]["error"]["message"], errors
            ready = await _wait_status(client, "/ready", 503, killed + DEAD_WITHIN_S)
            assert ready.status_code == 503 and ready.json()["status"] == "engine_unavailable"
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "engine_dead"
            refused = await client.post("/v1/completions", json={"model": srv.services.model_name,
                                                                  "prompt": "w1", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
        stats = llm.engine.stats()
        assert stats.kv.blocks_free == stats.kv.blocks_total, stats
    finally:
        await engine.shutdown()
        executor.shutdown()
    assert executor.workers.dead() == [1]
