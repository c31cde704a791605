"""The load generator behind `streamd bench serve`: synthetic prompts, lean WebSocket and SSE clients,
closed-loop and Poisson arrivals, and the latency/throughput report.

Over WebSocket, requests are multiplexed on a small pool of sockets (32 requests per socket), in
`streamd.v2` framing unless asked for v1; each socket's reader stamps the tokens of every frame straight
into its request's `Timing` (no queue or task hop per frame). Over SSE each request is a stream from
`/v1/completions` on a keep-alive connection of a minimal HTTP/1.1 client: an `asyncio.Protocol` whose
`data_received` feeds httptools' parser and counts events in its callbacks (no stream reader, no task hop), so
the client costs less CPU per token than the server it measures. Both run on uvloop when it is installed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools
import orjson

_WORDS = [
    "the",
    "a",
    "river",
    "city",
    "model",
    "token",
    "light",
    "stone",
    "paper",
    "garden",
    "engine",
    "quiet",
    "music",
    "north",
    "window",
    "memory",
    "signal",
    "winter",
    "orange",
    "bridge",
    "cloud",
    "number",
    "story",
    "market",
    "forest",
    "letter",
    "ocean",
]


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

    def __init__(self, url: str, size: int, api_key: str | None, framing: str = "v2") -> None:
        self.url, self.size, self.api_key, self.framing = url, size, api_key, framing
        self.sockets: list[Any] = []
        self.routes: dict[str, _WsRequest] = {}
        self.dead: set[Any] = set()  # sockets whose reader ended
        self._readers: list[asyncio.Task[None]] = []
        self._next = itertools.count()

    async def __aenter__(self) -> WebSocketPool:
        from websockets.asyncio.client import connect
        from websockets.typing import Subprotocol

        subprotocol = Subprotocol("streamd.v2" if self.framing == "v2" else "streamd.v1")
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        for _ in range(self.size):
            ws = await connect(
                self.url, subprotocols=[subprotocol], additional_headers=headers, max_size=None, compression=None
            )
            self.sockets.append(ws)
            self._readers.append(asyncio.create_task(self._read(ws)))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*(ws.close() for ws in self.sockets), return_exceptions=True)

    async def _read(self, ws: Any) -> None:
        routes = self.routes
        try:
            async for raw in ws:
                now = time.perf_counter()
                message = orjson.loads(raw)
                for frame in message if isinstance(message, list) else (message,):
                    request = routes.get(frame.get("id"))
                    if request is not None:
                        try:
                            request.take(frame, now)
                        except (KeyError, TypeError) as exc:  # a frame it cannot read fails its request alone
                            request.fail(f"unreadable frame: {type(exc).__name__}: {exc}")
        finally:  # the socket is gone: its requests, now and later, end with an error instead of waiting
            self.dead.add(ws)
            for request in list(routes.values()):
                if request.socket is ws:
                    request.fail("the WebSocket closed")

    async def generate(self, prompt: str, max_tokens: int) -> Timing:
        number = next(self._next)
        request_id = f"b{number}"
        ws = self.sockets[number % len(self.sockets)]
        if ws in self.dead:
            raise ConnectionError("the WebSocket closed")
        request = self.routes[request_id] = _WsRequest(
            ws, Timing(time.perf_counter()), asyncio.get_running_loop().create_future()
        )
        params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 1.0}
        try:
            await ws.send(
                orjson.dumps({"type": "generate", "id": request_id, "prompt": prompt, "params": params}).decode()
            )
            await request.done
        finally:
            del self.routes[request_id]
        request.timing.end = time.perf_counter()
        return request.timing


@dataclass(slots=True)
class _WsRequest:
    """One request in flight on a pool socket: its frames are read into `timing` as they arrive."""

    socket: Any
    timing: Timing
    done: asyncio.Future[None]

    def take(self, frame: dict[str, Any], now: float) -> None:
        kind, timing = frame["type"], self.timing
        if kind == "delta":
            timing.add(now, len(frame["token_ids"]))
        elif kind == "error":
            timing.error = frame["error"]["message"]
            if frame["error"]["code"] != "internal_error":
                self._end()  # refused: no done follows
        elif kind == "done":
            timing.error = timing.error or (
                None if frame["finish_reason"] in ("stop", "length") else frame["finish_reason"]
            )
            self._end()

    def fail(self, error: str) -> None:
        self.timing.error = self.timing.error or error
        self._end()

    def _end(self) -> None:
        if not self.done.done():
            self.done.set_result(None)


class SSEClient:
    """SSE streams from /v1/completions over keep-alive HTTP/1.1 connections, parsed with no HTTP library:
    one `data:` event is one delta (its arrival time is every token's in it); the usage chunk at the end
    gives the exact token count."""

    def __init__(self, base: str, api_key: str | None, model: str | None, continuous_usage: bool = False) -> None:
        """`continuous_usage`: ask for vLLM's `continuous_usage_stats` (every chunk carries the usage)."""
        parts = urlsplit(base)
        self.stream_options: dict[str, bool] = {"include_usage": True}  # the key only when asked: a peer may refuse it
        if continuous_usage:
            self.stream_options["continuous_usage_stats"] = True
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
        self.model = model
        self.idle: list[HttpConnection] = []

    async def __aenter__(self) -> SSEClient:
        if self.model is None:
            response = await self._request(self._head("GET", "/v1/models", b""), None)
            if response.status != 200:
                raise RuntimeError(f"GET /v1/models: HTTP {response.status}")
            self.model = orjson.loads(response.body())["data"][0]["id"]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        for connection in self.idle:
            connection.transport.close()

    def _head(self, method: str, path: str, body: bytes) -> bytes:
        return (
            f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n{self.auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body

    async def _request(self, request: bytes, on_chunk: Callable[[bytes, float], None] | None) -> HttpResponse:
        """Sends on a kept-alive connection, or on a fresh one when nothing came back on it (the server closed
        it while idle); the whole response once it has ended (`on_chunk`: a 200 chunked body's pieces go there
        as they arrive)."""
        for attempt in range(2):
            reused = attempt == 0 and bool(self.idle)  # a retry always takes a fresh connection
            connection = self.idle.pop() if reused else await self._connect()
            response = connection.send(request, on_chunk)
            try:
                await response.done
            except ConnectionError:
                if response.started or not reused:
                    raise
                continue
            if connection.closed:
                connection.transport.close()
            else:
                self.idle.append(connection)
            return response
        raise AssertionError("unreachable")

    async def _connect(self) -> HttpConnection:
        _, connection = await asyncio.get_running_loop().create_connection(HttpConnection, self.host, self.port)
        return connection

    async def generate(self, prompt: str, max_tokens: int) -> Timing:
        body = orjson.dumps(
            {
                "model": self.model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
                "stream_options": self.stream_options,
            }
        )
        timing = Timing(time.perf_counter())
        events, partial = 0, b""

        def on_chunk(piece: bytes, now: float) -> None:  # events end in a blank line; a piece may cut one
            nonlocal events, partial
            *complete, partial = (partial + piece).split(b"\n\n")
            for event in complete:
                if not event.startswith(b"data: {"):
                    continue
                if b'"choices":[]' in event:  # the usage chunk (with continuous usage every chunk has one)
                    timing.tokens = orjson.loads(event[6:])["usage"]["completion_tokens"]
                elif b'"error":' in event:
                    timing.error = orjson.loads(event[6:])["error"]["message"]
                elif b'"text":""' not in event:
                    events += 1
                    timing.token_times.append(now)

        response = await self._request(self._head("POST", "/v1/completions", body), on_chunk)
        if response.status != 200 or not response.chunked:
            timing.error = f"HTTP {response.status}: {response.body()[:200]!r}"
        elif timing.tokens == 0:
            timing.tokens = events
        timing.end = time.perf_counter()
        return timing


class HttpResponse:
    """One response as `HttpConnection` parses it: status, whether chunked, the body (or its pieces handed
    to `on_chunk` with their arrival time, for a 200 chunked body), and `done` once it has ended."""

    __slots__ = ("chunked", "done", "on_chunk", "parts", "started", "status")

    def __init__(self, on_chunk: Callable[[bytes, float], None] | None) -> None:
        self.status, self.chunked, self.started = 0, False, False
        self.parts: list[bytes] = []
        self.on_chunk = on_chunk
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def body(self) -> bytes:
        return b"".join(self.parts)

    def chunk(self, data: bytes, now: float) -> None:
        if self.on_chunk is not None and self.status == 200:
            self.on_chunk(data, now)
        else:
            self.parts.append(data)


class HttpConnection(asyncio.Protocol):
    """A keep-alive HTTP/1.1 connection, one response at a time, parsed as it arrives by httptools (the
    server's own parser): its callbacks below fill the current `HttpResponse`."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.parser = httptools.HttpResponseParser(self)
        self.response: HttpResponse | None = None
        self.keep_alive = True
        self.now = 0.0  # when the data being parsed arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    @property
    def closed(self) -> bool:
        """The server closed it, or said it would (`Connection: close`): never reused."""
        return self.transport.is_closing() or not self.keep_alive

    def send(self, request: bytes, on_chunk: Callable[[bytes, float], None] | None) -> HttpResponse:
        response = self.response = HttpResponse(on_chunk)
        if self.transport.is_closing():  # the server closed it while it was idle
            self.connection_lost(None)
        else:
            self.transport.write(request)
        return response

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # its response (if any) fails in connection_lost

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None and name.lower() == b"transfer-encoding" and b"chunked" in value.lower():
            self.response.chunked = True

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status, self.response.started = self.parser.get_status_code(), True
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.chunk(body, self.now)

    def on_message_complete(self) -> None:
        response, self.response = self.response, None
        if response is not None and not response.done.done():
            response.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        response, self.response = self.response, None
        if response is not None and not response.done.done():
            response.done.set_exception(ConnectionResetError("the server closed the connection"))


async def run_load(args: argparse.Namespace) -> tuple[list[Timing], float]:
    prompts = synthetic_prompts(args.num_requests, args.prompt_words, args.seed)
    concurrency = _concurrency(args)
    limit = concurrency or args.num_requests
    base = args.url.rstrip("/")
    if args.transport == "ws":
        ws_url = base.replace("http://", "ws://").replace("https://", "wss://") + "/v1/stream"
        size = args.connections or max(1, min(16, math.ceil(limit / 32)))
        client: Any = WebSocketPool(ws_url, size, args.api_key, args.framing)
    else:
        client = SSEClient(base, args.api_key, args.model, args.continuous_usage)
    async with client:
        start = time.perf_counter()
        if concurrency:
            timings = await closed_loop(client, prompts, args.max_tokens, concurrency)
        else:
            timings = await _poisson(client, prompts, args.max_tokens, args.rate, random.Random(args.seed))
        return timings, time.perf_counter() - start


def _concurrency(args: argparse.Namespace) -> int | None:
    """Requests kept in flight: `--concurrency`, else 8 unless `--rate` asks for Poisson arrivals (None)."""
    return args.concurrency or (None if args.rate else 8)


async def closed_loop(client: Any, prompts: list[str], max_tokens: int, concurrency: int) -> list[Timing]:
    queue = list(reversed(prompts))
    timings: list[Timing] = []

    async def worker() -> None:
        while queue:
            timings.append(await _safe(client, queue.pop(), max_tokens))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return timings


async def _poisson(client: Any, prompts: list[str], max_tokens: int, rate: float, rng: random.Random) -> list[Timing]:
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


def first_token_times(timings: list[Timing]) -> list[float]:
    """Seconds from each completed request's send to its first token."""
    return [t.token_times[0] - t.sent for t in timings if t.error is None and t.token_times]


def inter_token_gaps(timings: list[Timing]) -> list[float]:
    """Seconds between consecutive token arrivals of each completed request."""
    return [b - a for t in timings if t.error is None for a, b in zip(t.token_times, t.token_times[1:])]


def report(timings: list[Timing], duration: float, args: argparse.Namespace) -> dict[str, Any]:
    ok = [t for t in timings if t.error is None]
    ttft = first_token_times(ok)
    itl = inter_token_gaps(ok)
    e2e = [t.end - t.sent for t in ok]
    tokens = sum(t.tokens for t in ok)
    errors = sorted({t.error for t in timings if t.error})[:5]
    return {
        "transport": args.transport,
        "mode": "poisson" if args.rate else "concurrency",
        "rate": args.rate,
        "concurrency": _concurrency(args),
        "num_requests": len(timings),
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_token_throughput": tokens / duration if duration else 0.0,
        "output_tokens": tokens,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles(e2e),
        "errors": errors,
    }


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"streamd bench serve · {result['transport']} · {result['mode']} · "
        f"{result['completed']}/{result['num_requests']} ok in {result['duration_s']:.2f} s",
        f"throughput: {result['request_throughput']:.2f} req/s, {result['output_token_throughput']:.1f} output tok/s",
        f"{'':<6}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'mean ms':>10}",
    ]
    for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
        row = result[key]
        cells = "".join(
            f"{'-' if row[q] is None else f'{row[q] * 1000:.1f}':>10}" for q in ("p50", "p90", "p99", "mean")
        )
        lines.append(f"{name:<6}{cells}")
    lines += [f"error: {e}" for e in result["errors"]]
    return "\n".join(lines)
