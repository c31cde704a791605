"""Load a running server (`streamd bench serve`): Poisson arrivals or a fixed concurrency, over WebSocket or HTTP.

Reports request and output-token throughput and p50/p90/p99 of time to first token (TTFT), inter-token
latency (ITL, every gap between consecutive tokens) and end-to-end latency (E2E), as a table and as JSON.
Prompts are synthetic (seeded), and `ignore_eos` makes every request produce exactly `--max-tokens`, so
runs are comparable. Over WebSocket, requests are multiplexed on a small pool of sockets, as the
`streamd.v1` protocol intends; over HTTP each request is an SSE stream from `/v1/completions`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

_WORDS = ("the a river city model token light stone paper garden engine quiet music north window "
          "memory signal winter orange bridge cloud number story market forest letter ocean").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--transport", choices=("ws", "http"), default="ws")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="Poisson arrival rate, requests/s")
    load.add_argument("--concurrency", type=int, help="requests kept in flight (default 8 without --rate)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=64, help="words per synthetic prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--connections", type=int, default=0, help="WebSocket pool size (0: automatic)")
    parser.add_argument("--api-key")
    parser.add_argument("--model", help="model name for HTTP requests (default: the server's first)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON here ('-' for stdout)")


@dataclass(slots=True)
class Timing:
    """One request: when it was sent, when each token arrived, how it ended."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0
    tokens: int = 0
    error: str | None = None

    def add(self, now: float, count: int) -> None:
        self.token_times.extend([now] * count)  # tokens of one frame arrived together
        self.tokens += count


def synthetic_prompts(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"Request {i}: " + " ".join(rng.choice(_WORDS) for _ in range(words)) for i in range(count)]


class WebSocketPool:
    """A few sockets; requests are spread over them and their frames routed back by id."""

    def __init__(self, url: str, size: int, api_key: str | None) -> None:
        self.url, self.size, self.api_key = url, size, api_key
        self.sockets: list[Any] = []
        self.routes: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._next = itertools.count()

    async def __aenter__(self) -> WebSocketPool:
        from websockets.asyncio.client import connect

        from streamd.server.protocol import SUBPROTOCOL

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        for _ in range(self.size):
            ws = await connect(self.url, subprotocols=[SUBPROTOCOL], additional_headers=headers, max_size=None)
            self.sockets.append(ws)
            self._readers.append(asyncio.create_task(self._read(ws)))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*(ws.close() for ws in self.sockets), return_exceptions=True)

    async def _read(self, ws: Any) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            queue = self.routes.get(frame.get("id"))
            if queue is not None:
                queue.put_nowait(frame)

    async def generate(self, prompt: str, max_tokens: int) -> Timing:
        number = next(self._next)
        request_id = f"b{number}"
        queue = self.routes[request_id] = asyncio.Queue()
        ws = self.sockets[number % len(self.sockets)]
        timing = Timing(time.perf_counter())
        params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
        try:
            await ws.send(json.dumps({"type": "generate", "id": request_id, "prompt": prompt, "params": params}))
            while True:
                frame = await queue.get()
                if frame["type"] == "delta":
                    timing.add(time.perf_counter(), len(frame["token_ids"]))
                elif frame["type"] == "error":
                    timing.error = frame["error"]["message"]
                    if frame["error"]["code"] != "internal_error":
                        break  # refused: no done follows
                elif frame["type"] == "done":
                    timing.error = timing.error or (None if frame["finish_reason"] in ("stop", "length")
                                                    else frame["finish_reason"])
                    break
        finally:
            del self.routes[request_id]
        timing.end = time.perf_counter()
        return timing


class HttpClient:
    """SSE streams from /v1/completions; usage chunks give the exact token count at the end."""

    def __init__(self, base: str, api_key: str | None, model: str | None, limit: int) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=base, headers=headers, timeout=httpx.Timeout(600, connect=30),
                                        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit))
        self.model = model

    async def __aenter__(self) -> HttpClient:
        if self.model is None:
            response = await self.client.get("/v1/models")
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.client.aclose()

    async def generate(self, prompt: str, max_tokens: int) -> Timing:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        timing = Timing(time.perf_counter())
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            else:
                await self._read_events(response, timing)
        timing.end = time.perf_counter()
        return timing

    @staticmethod
    async def _read_events(response: Any, timing: Timing) -> None:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                timing.error = chunk["error"]["message"]
            elif chunk.get("usage"):
                timing.tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                timing.add(time.perf_counter(), 1)  # SSE carries text, ~one token per chunk


async def run_load(args: argparse.Namespace) -> tuple[list[Timing], float]:
    prompts = synthetic_prompts(args.num_requests, args.prompt_words, args.seed)
    concurrency = args.concurrency or (None if args.rate else 8)
    limit = concurrency or args.num_requests
    base = args.url.rstrip("/")
    if args.transport == "ws":
        ws_url = base.replace("http://", "ws://").replace("https://", "wss://") + "/v1/stream"
        size = args.connections or max(1, min(16, math.ceil(limit / 32)))
        client: Any = WebSocketPool(ws_url, size, args.api_key)
    else:
        client = HttpClient(base, args.api_key, args.model, limit)
    async with client:
        start = time.perf_counter()
        if concurrency:
            timings = await _closed_loop(client, prompts, args.max_tokens, concurrency)
        else:
            timings = await _poisson(client, prompts, args.max_tokens, args.rate, random.Random(args.seed))
        return timings, time.perf_counter() - start


async def _closed_loop(client: Any, prompts: list[str], max_tokens: int, concurrency: int) -> list[Timing]:
    queue = list(reversed(prompts))
    timings: list[Timing] = []

    async def worker() -> None:
        while queue:
            timings.append(await _safe(client, queue.pop(), max_tokens))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings


async def _poisson(client: Any, prompts: list[str], max_tokens: int, rate: float,
                   rng: random.Random) -> list[Timing]:
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(_safe(client, prompt, max_tokens)))
        await asyncio.sleep(rng.expovariate(rate))  # the arrival schedule itself
    return list(await asyncio.gather(*tasks))


async def _safe(client: Any, prompt: str, max_tokens: int) -> Timing:
    sent = time.perf_counter()
    try:
        return await client.generate(prompt, max_tokens)
    except Exception as exc:  # a failed request is a data point, not the end of the run
        return Timing(sent, end=time.perf_counter(), error=f"{type(exc).__name__}: {exc}")


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)

    def at(q: float) -> float:  # nearest-rank
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return {"p50": at(0.50), "p90": at(0.90), "p99": at(0.99), "mean": sum(ordered) / len(ordered)}


def report(timings: list[Timing], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    ttft = [t.token_times[0] - t.sent for t in ok if t.token_times]
    itl = [b - a for t in ok for a, b in zip(t.token_times, t.token_times[1:])]
    e2e = [t.end - t.sent for t in ok]
    tokens = sum(t.tokens for t in ok)
    errors = sorted({t.error for t in timings if t.error})[:5]
    return {
        "transport": args.transport, "mode": "poisson" if args.rate else "concurrency",
        "rate": args.rate, "concurrency": args.concurrency or (None if args.rate else 8),
        "num_requests": len(timings), "completed": len(ok), "failed": len(timings) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": tokens / duration if duration else 0.0, "output_tokens": tokens,
        "ttft_s": percentiles(ttft), "itl_s": percentiles(itl), "e2e_s": percentiles(e2e), "errors": errors,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [f"streamd bench serve · {result['transport']} · {result['mode']} · "
             f"{result['completed']}/{result['num_requests']} ok in {result['duration_s']:.2f} s",
             f"throughput: {result['request_throughput']:.2f} req/s, "
             f"{result['output_token_throughput']:.1f} output tok/s",
             f"{'':<6}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'mean ms':>10}"]
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        row = result[key]
        cells = "".join(f"{'-' if row[q] is None else f'{row[q] * 1000:.1f}':>10}" for q in ("p50", "p90", "p99", "mean"))
        lines.append(f"{name:<6}{cells}")
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    timings, duration = asyncio.run(run_load(args))
    result = report(timings, duration, args)
    print(format_table(result))
    if args.json == "-":
        json.dump(result, sys.stdout, indent=2)
        print()
    elif args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return 0 if result["completed"] else 1

