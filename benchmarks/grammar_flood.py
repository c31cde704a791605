"""Issue 35 D2 before/after: a control stream's inter-token latency while 8 cheap-to-send, costly-to-compile
schemas arrive, and how long a trivial schema waits meanwhile. In-process server on the default model (CPU).

    PYTHONPATH=. python -P benchmarks/grammar_flood.py [--window 40] [--big 8] [--properties 2000]

(-P: benchmarks/kernels.py would shadow the `kernels` package transformers imports.)

Runs on any commit that has `create_app` (the same script measured the base and the fix). The big compiles
that cannot be interrupted (before the fix) keep running after the report; the process exits hard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

import httpx
from websockets.asyncio.client import connect

from streamd import LLM
from streamd.config import load_config
from streamd.engine.client.async_engine import AsyncEngine
from streamd.server.app import create_app
from streamd.server.serve import DrainingServer, uvicorn_config


def pct(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 1) if ordered else None


async def control(port: int, itl: list[tuple[float, float]], stop: asyncio.Event) -> None:
    async with connect(f"ws://127.0.0.1:{port}/v1/stream", subprotocols=["streamd.v1"], max_size=None) as ws:
        n = 0
        while not stop.is_set():
            n += 1
            params = {"max_tokens": 32, "ignore_eos": True, "temperature": 0}
            await ws.send(json.dumps({"type": "generate", "id": f"c{n}", "prompt": "Count:", "params": params}))
            last = None
            while True:
                frame = json.loads(await ws.recv())
                now = time.monotonic()
                if frame["type"] == "delta":
                    if last is not None:
                        itl.append((now, now - last))
                    last = now
                if frame["type"] in ("done", "error"):
                    break


def chat(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }


async def timed_post(http: httpx.AsyncClient, body: dict[str, Any], timeout: float) -> tuple[float, str]:
    start = time.monotonic()
    try:
        answer = await asyncio.wait_for(http.post("/v1/chat/completions", json=body), timeout)
        return time.monotonic() - start, str(answer.status_code)
    except TimeoutError:
        return time.monotonic() - start, "no answer"


async def main(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=512, max_num_batched_tokens=256, num_swap_blocks=0)
    engine = AsyncEngine(llm.engine)
    config = load_config(
        overrides={"server.host": "127.0.0.1", "server.port": 0, "server.max_body_bytes": 8 << 20}, environ={}
    )
    app = create_app(config, engine, warm_up=False)
    server = DrainingServer(uvicorn_config(config, app), app.state.services.lifecycle, 0)
    background = [asyncio.create_task(server.serve())]
    await server.listening.wait()
    port = server.port
    assert port is not None
    itl: list[tuple[float, float]] = []
    stop = asyncio.Event()
    background.append(asyncio.create_task(control(port, itl, stop)))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=None) as http:
        await asyncio.sleep(2)  # (a benchmark: let the control stream run)
        alone = time.monotonic()
        trivial_alone = await timed_post(
            http, chat({"type": "object", "properties": {"warm": {"type": "integer"}}}), 60
        )
        await asyncio.sleep(args.quiet)
        flood = time.monotonic()
        bigs = [
            asyncio.create_task(
                timed_post(
                    http,
                    chat(
                        {
                            "type": "object",
                            "properties": {f"b{k}_{i}": {"type": "integer"} for i in range(args.properties)},
                        }
                    ),
                    args.window,
                )
            )
            for k in range(args.big)
        ]
        await asyncio.sleep(1)
        trivial = await timed_post(
            http, chat({"type": "object", "properties": {"t": {"type": "integer"}}}), args.window
        )
        big_results = await asyncio.gather(*bigs)
        remaining = flood + args.window - time.monotonic()
        if remaining > 0:
            await asyncio.sleep(remaining)
        end = time.monotonic()
    stop.set()
    before = [d for t, d in itl if alone <= t < flood]
    during = [d for t, d in itl if flood <= t < end]
    return {
        "control_itl_quiet_ms": {"p50": pct(before, 0.5), "p99": pct(before, 0.99), "n": len(before)},
        "control_itl_flood_ms": {"p50": pct(during, 0.5), "p99": pct(during, 0.99), "n": len(during)},
        "trivial_schema_quiet_s": round(trivial_alone[0], 2),
        "trivial_schema_flood_s": round(trivial[0], 2),
        "trivial_status": trivial[1],
        "big_schemas": [(round(t, 1), status) for t, status in big_results],
        "window_s": args.window,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--window", type=float, default=40.0, help="seconds of flood measured")
    parser.add_argument("--quiet", type=float, default=8.0, help="seconds of control stream alone")
    parser.add_argument("--big", type=int, default=8)
    parser.add_argument("--properties", type=int, default=2000)
    print(json.dumps(asyncio.run(main(parser.parse_args())), indent=1), flush=True)
    os._exit(0)
