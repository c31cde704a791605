"""Chaos against a running server (`streamd bench chaos`): storms, fuzzing and slow readers for a while.

Scenarios, all at once for `--duration` seconds:
- storm: clients open a WebSocket, start several streams, then cancel them, reset the TCP connection
  (SO_LINGER 0), close cleanly or half-handshake and vanish;
- fuzz: malformed frames (bad JSON, lone surrogates, deep nesting, bad ids, unknown types and fields,
  out-of-range params, binary frames); every frame must be answered and the socket must stay open;
- slow reader: a client that starts streams and never reads, for the whole run, on `/v1/stream` and on
  the Responses socket (`/v1/responses`, one long response);
- frame flood (`--flooders`): a client that sends tiny invalid frames and never reads the error replies,
  on each WebSocket route in turn (the server must bound what it queues for it and close it, 1008);
- schema flood: structured requests whose schemas are cheap to send and costly to compile (2,000 optional
  properties: over the compile budget; 600: heavy, takes a compile slot), each distinct (no cache hit),
  with a trivial schema after each batch whose wait for its first token is reported;
- control: one stream after another on its own socket, whose inter-token latency (ITL) is reported;
- socket flood (`--flood-sockets`, `--body-holders`): silent sockets, and sockets that send all but the last byte
  of a declared body, from another client address (`--flood-from`, a loopback alias for a local server, so
  the caps per client address spare the other scenarios); the server must answer each one (503 over its
  caps, 408 at its read deadlines) or still hold it when the run ends, never close one unanswered;
- long prompt (`--long-prompt-tokens`): one prompt of about that many tokens, sent once the control
  stream runs; the control stream's largest gap (issue 35: a long prefill used to freeze every stream)
  and the long prompt's time to first token are reported;
- background kills (`--background-kills N`, `chaos_background.py`): background Responses streams reset at a
  random event and resumed with `starting_after`; every sequence number once, the reference's exact text.

All along it samples the server's descriptors and resident memory from `/metrics` (prometheus-client's
process collector); the run fails when they grew more than `--max-fd-growth` / `--max-rss-growth-mb` or
the descriptors are not back near where they started once the server is idle. Afterwards it waits for the
server to go idle and reads its KV gauges: blocks still used then are leaks. Reports requests, tokens,
errors by code, leaks, the flood's answers and the control stream's p99 and largest ITL, as a table and
as JSON. Example: `streamd bench chaos --url http://127.0.0.1:8000 --duration 60`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import struct
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.typing import Subprotocol

from streamd.bench.chaos_background import background_kills
from streamd.bench.load import percentiles
from streamd.bench.report import add_json_argument, write_json

IDLE_TIMEOUT_S = 60.0
FD_SLACK = 16  # descriptors a server may hold after the run beyond those it held before (logs, caches)
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "sky", "with", "quiet", "joy")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of chaos")
    parser.add_argument("--storm-clients", type=int, default=8, help="storm clients running at once")
    parser.add_argument("--fuzzers", type=int, default=2)
    parser.add_argument("--slow-readers", type=int, default=2, help="per WebSocket route")
    parser.add_argument("--flooders", type=int, default=1, help="clients flooding frames they never read")
    parser.add_argument("--schema-flooders", type=int, default=1, help="clients sending costly schemas")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per storm and control stream")
    parser.add_argument("--api-key")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flood-sockets", type=int, default=0, help="silent sockets opened at the start (0: none)")
    parser.add_argument("--body-holders", type=int, default=0, help="sockets that hold all but one byte of a body")
    parser.add_argument("--body-bytes", type=int, default=8 << 20, help="the body length the holders declare")
    parser.add_argument("--flood-from", default="127.0.0.2", help="the flood's source address ('': the default)")
    parser.add_argument("--max-fd-growth", type=int, default=300, help="descriptors the server may add during the run")
    parser.add_argument("--max-rss-growth-mb", type=float, default=400.0, help="resident MB the server may add")
    parser.add_argument(
        "--long-prompt-tokens", type=int, default=0, help="a prompt of about this many tokens (0: none)"
    )
    parser.add_argument("--background-kills", type=int, default=0, help="background Responses streams reset (0: none)")
    parser.add_argument("--background-concurrency", type=int, default=8, help="kill rounds at once")
    add_json_argument(parser)


@dataclass(slots=True)
class Tally:
    requests: int = 0  # generate frames sent
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # error frames by code (+ client-side failures)
    unanswered: int = 0  # fuzz frames that got no answer
    control_itl: list[float] = field(default_factory=list)
    control_streams: int = 0
    flood_frames: int = 0  # unread-reply frames the frame flooders sent
    flooders_closed: int = 0  # frame flooders' sockets the server closed (1008: replies unread)
    trivial_schema_waits: list[float] = field(default_factory=list)  # a trivial schema's first token, flooded
    control_running: asyncio.Event = field(default_factory=asyncio.Event)
    flood: Counter[str] = field(default_factory=Counter)  # the flood's sockets by what the server did
    process: dict[str, float] = field(default_factory=dict)  # the server's fds and RSS: before, max, after
    long_prompt: dict[str, float] = field(default_factory=dict)  # its prompt tokens and time to first token
    background: dict[str, Any] = field(default_factory=dict)  # the background kills' report


@dataclass(slots=True)
class Target:
    http: str
    ws: str
    host: str
    port: int
    headers: dict[str, str]
    max_tokens: int

    @property
    def responses_ws(self) -> str:
        return self.ws.removesuffix("/v1/stream") + "/v1/responses"


def target_of(args: argparse.Namespace) -> Target:
    parts = urlsplit(args.url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return Target(
        args.url.rstrip("/"),
        f"{scheme}://{parts.netloc}/v1/stream",
        parts.hostname or "127.0.0.1",
        port,
        headers,
        args.max_tokens,
    )


def _connect(target: Target, responses: bool = False) -> Any:
    return connect(
        target.responses_ws if responses else target.ws,
        subprotocols=None if responses else [Subprotocol("streamd.v1")],
        additional_headers=target.headers,
        max_size=None,
        open_timeout=30,
        ping_interval=None,  # (a client that stops reading would fail its own pings)
    )


def _generate(request_id: str, prompt: str, max_tokens: int) -> str:
    return json.dumps(
        {
            "type": "generate",
            "id": request_id,
            "prompt": prompt,
            "params": {"max_tokens": max_tokens, "ignore_eos": True},
        }
    )


def _reset(ws: ClientConnection) -> None:
    sock = ws.transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    ws.transport.abort()


async def _read_frame(ws: ClientConnection, tally: Tally) -> dict[str, Any]:
    frame = json.loads(await ws.recv())
    if frame["type"] == "delta":
        tally.tokens += len(frame["token_ids"])
    elif frame["type"] == "error":
        tally.errors[frame["error"]["code"]] += 1
    return frame


# ---- scenarios ----------------------------------------------------------------------------------------
async def storm(target: Target, tally: Tally, rng: random.Random, until: float) -> None:
    n = 0
    while time.monotonic() < until:
        n += 1
        try:
            async with _connect(target) as ws:
                ids = [f"s{n}-{i}" for i in range(rng.randint(1, 6))]
                for request_id in ids:
                    await ws.send(_generate(request_id, f"Story {rng.random()}", target.max_tokens))
                    tally.requests += 1
                for _ in range(rng.randint(0, 3 * len(ids))):
                    await _read_frame(ws, tally)
                action = rng.choice(["cancel", "reset", "close", "finish"])
                if action == "reset":
                    _reset(ws)
                    continue
                if action == "close":
                    continue
                if action == "cancel":
                    for request_id in ids:
                        await ws.send(json.dumps({"type": "cancel", "id": request_id}))
                pending = set(ids)
                while pending:
                    frame = await _read_frame(ws, tally)
                    if frame["type"] in ("done", "error") and frame.get("id") in pending:
                        pending.discard(frame["id"])
        except (ConnectionClosed, InvalidStatus, OSError) as exc:
            tally.errors[f"client:{type(exc).__name__}"] += 1


def fuzz_frame(rng: random.Random, index: int) -> tuple[str | bytes, bool]:
    """A malformed or odd frame, and whether its answer carries its id (else an error with id null)."""
    fid = f"f{index}"
    kind = rng.randrange(9)
    if kind == 0:
        return "{not json", False
    if kind == 1:
        return json.dumps({"type": "generate", "id": fid, "prompt": "Hi \ud800"}), False
    if kind == 2:
        return "[" * 3000 + "]" * 3000, False
    if kind == 3:
        return json.dumps({"type": "generate", "id": rng.choice(["", 7, None, "x" * 300]), "prompt": "Hi"}), False
    if kind == 4:
        return json.dumps({"type": "launch", "id": fid}), True
    if kind == 5:
        return json.dumps({"type": "generate", "id": fid, "prompt": "Hi", "params": {"temperature": 1e300}}), True
    if kind == 6:
        return json.dumps({"type": "generate", "id": fid, "prompt": "Hi", "params": {"stop": ["s"] * 1000}}), True
    if kind == 7:
        return bytes(rng.randrange(256) for _ in range(16)), False
    return json.dumps({"type": "cancel", "id": fid}), True


async def fuzz(target: Target, tally: Tally, rng: random.Random, until: float) -> None:
    """Batches of fuzz frames; a frame is unanswered when its answer does not come in 30 s or the server
    closes the socket before it (the server must answer bad frames, never drop the connection)."""
    index, expected, nulls = 0, set[str](), 0
    try:
        async with _connect(target) as ws:
            while time.monotonic() < until:
                batch = [fuzz_frame(rng, index + i) for i in range(20)]
                index += len(batch)
                expected = {f"f{index - len(batch) + i}" for i, (_, has_id) in enumerate(batch) if has_id}
                nulls = sum(1 for _, has_id in batch if not has_id)
                for text, _ in batch:
                    await ws.send(text)
                    tally.requests += 1
                try:
                    async with asyncio.timeout(30):
                        while expected or nulls:
                            frame = await _read_frame(ws, tally)
                            if frame["type"] in ("error", "done") and frame.get("id") in expected:
                                expected.discard(frame["id"])
                            elif frame["type"] == "error" and frame.get("id") is None:
                                nulls -= 1
                except TimeoutError:
                    pass
                tally.unanswered += len(expected) + nulls
                expected, nulls = set(), 0
    except (ConnectionClosed, InvalidStatus, OSError) as exc:
        tally.unanswered += len(expected) + nulls  # the frames a dropped socket left unanswered
        tally.errors[f"client:{type(exc).__name__}"] += 1


async def slow_reader(target: Target, tally: Tally, until: float, responses: bool = False) -> None:
    try:
        async with _connect(target, responses) as ws:
            for i in range(1 if responses else 4):
                await ws.send(
                    _response(10 * target.max_tokens)
                    if responses
                    else _generate(f"slow{i}", "Write a long story", 10 * target.max_tokens)
                )
                tally.requests += 1
            ws.transport.pause_reading()  # never read: the server's writes back up
            await asyncio.sleep(max(0.0, until - time.monotonic()))
            _reset(ws)
    except (ConnectionClosed, InvalidStatus, OSError) as exc:
        tally.errors[f"client:{type(exc).__name__}"] += 1


def _response(max_tokens: int) -> str:
    return json.dumps(
        {"type": "response.create", "input": "Write a long story", "max_output_tokens": max_tokens, "top_logprobs": 20}
    )


async def frame_flood(target: Target, tally: Tally, until: float, responses: bool) -> None:
    """Tiny invalid frames, replies never read, until the run ends or the server closes the socket."""
    try:
        async with _connect(target, responses) as ws:
            ws.transport.pause_reading()
            while time.monotonic() < until:
                for _ in range(100):
                    await ws.send("x")
                tally.flood_frames += 100
            _reset(ws)
    except ConnectionClosed:
        tally.flooders_closed += 1
    except (InvalidStatus, OSError) as exc:
        tally.errors[f"client:{type(exc).__name__}"] += 1


def _schema_frame(request_id: str, properties: int, tag: str) -> str:
    properties_ = {f"p{i}": {"type": "integer"} for i in range(properties)}  # (under a 64 KiB frame at 2,000)
    schema = {"type": "object", "description": tag, "properties": properties_}
    params = {"max_tokens": 2, "structured_outputs": {"json": schema}}
    return json.dumps({"type": "generate", "id": request_id, "prompt": "Hi", "params": params})


async def schema_flood(target: Target, tally: Tally, rng: random.Random, until: float) -> None:
    """Batches of costly schemas, then a trivial one whose wait for its first frame is timed."""
    n = 0
    try:
        async with _connect(target) as ws:
            while time.monotonic() < until:
                n += 1
                tag = f"x{rng.getrandbits(32):x}"
                batch = {f"big{n}": 2000, f"heavy{n}a": 600, f"heavy{n}b": 600, f"heavy{n}c": 600}
                for request_id, properties in batch.items():
                    await ws.send(_schema_frame(request_id, properties, f"{tag}{request_id}"))
                trivial, sent = f"trivial{n}", time.monotonic()
                await ws.send(_schema_frame(trivial, 2, tag))
                tally.requests += len(batch) + 1
                pending, waited = {*batch, trivial}, None
                while pending:
                    frame = await _read_frame(ws, tally)
                    if frame.get("id") == trivial and waited is None:
                        waited = time.monotonic() - sent
                    if frame["type"] in ("done", "error"):
                        pending.discard(frame.get("id"))
                tally.trivial_schema_waits.append(waited or 0.0)
    except (ConnectionClosed, InvalidStatus, OSError) as exc:
        tally.errors[f"client:{type(exc).__name__}"] += 1


async def control(target: Target, tally: Tally, until: float) -> None:
    try:
        async with _connect(target) as ws:
            while time.monotonic() < until:
                request_id = f"ctl{tally.control_streams}"
                await ws.send(_generate(request_id, "Count to one hundred:", target.max_tokens))
                tally.requests += 1
                last = None
                while True:
                    frame = await _read_frame(ws, tally)
                    now = time.monotonic()
                    if frame["type"] == "delta":
                        if last is not None:
                            tally.control_itl.append(now - last)
                        last = now
                        tally.control_running.set()
                    if frame["type"] in ("done", "error") and frame.get("id") == request_id:
                        break
                tally.control_streams += 1
    except (ConnectionClosed, InvalidStatus, OSError) as exc:
        tally.errors[f"client:{type(exc).__name__}"] += 1


async def flood(target: Target, tally: Tally, args: argparse.Namespace, until: float) -> None:
    """Silent sockets and body holders from `--flood-from`, each kept until the server answers and closes
    it or the run ends; counted by the status it got ("held": still open at the end, "unanswered": closed
    without a word)."""
    local = (args.flood_from, 0) if args.flood_from else None
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {target.host}\r\nContent-Type: application/json\r\n"
    held = b"%sContent-Length: %d\r\n\r\n" % (head.encode(), args.body_bytes) + b" " * (args.body_bytes - 1)
    sockets = []
    for i in range(args.flood_sockets + args.body_holders):
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port, local_addr=local)
        except OSError:
            tally.flood["connect_failed"] += 1
            continue
        if i >= args.flood_sockets:
            writer.write(held)
        sockets.append((reader, writer))
    outcomes = await asyncio.gather(*(_flood_answer(reader, until) for reader, _ in sockets))
    tally.flood.update(outcomes)
    for _, writer in sockets:
        writer.close()


async def _flood_answer(reader: asyncio.StreamReader, until: float) -> str:
    try:
        async with asyncio.timeout(max(0.0, until - time.monotonic())):
            line = await reader.readline()
    except TimeoutError:
        return "held"
    except OSError:
        return "reset"
    return line.split(b" ")[1].decode() if line.startswith(b"HTTP/1.1 ") else "unanswered"


async def long_prompt(target: Target, tally: Tally, tokens: int, rng: random.Random) -> None:
    """Once the control stream runs: one prompt of about `tokens` tokens, timed to its first token."""
    await tally.control_running.wait()
    prompt = " ".join(rng.choice(WORDS) for _ in range(tokens))
    try:
        async with _connect(target) as ws:
            await ws.send(_generate("long", prompt, 1))
            tally.requests += 1
            sent = time.monotonic()
            while True:
                frame = await _read_frame(ws, tally)
                if frame["type"] == "start":
                    tally.long_prompt["prompt_tokens"] = frame["prompt_tokens"]
                if frame["type"] in ("delta", "done", "error"):
                    tally.long_prompt["ttft_s"] = round(time.monotonic() - sent, 2)
                    return
    except (ConnectionClosed, InvalidStatus, OSError) as exc:
        tally.errors[f"client:{type(exc).__name__}"] += 1


async def sample_process(target: Target, tally: Tally, until: float) -> None:
    """The server's largest descriptor count and resident memory while the run lasts (sampled at least once,
    so a run of only background kills, `--duration 0`, still reports them)."""
    while True:
        _note_process(tally, await metrics(target), "max", max)
        if time.monotonic() >= until:
            return
        await asyncio.sleep(0.5)  # polling a remote server's gauges: there is nothing to wait on


def _note_process(tally: Tally, m: dict[str, float], when: str, keep: Any = None) -> None:
    for name, value in (
        ("fds", m.get("process_open_fds", 0.0)),
        ("rss_mb", m.get("process_resident_memory_bytes", 0.0) / 1e6),
    ):
        key = f"server_{name}_{when}"
        tally.process[key] = keep(tally.process.get(key, value), value) if keep else value


# ---- after the run ------------------------------------------------------------------------------------
async def metrics(target: Target) -> dict[str, float]:
    """The server's unlabelled gauges and counters (sums over labels) from /metrics."""
    reader, writer = await asyncio.open_connection(target.host, target.port)
    auth = "".join(f"{k}: {v}\r\n" for k, v in target.headers.items())
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: {target.host}\r\n{auth}Connection: close\r\n\r\n".encode())
    body = (await reader.read()).decode(errors="replace").split("\r\n\r\n", 1)[-1]
    writer.close()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


async def idle_metrics(target: Target) -> tuple[bool, dict[str, float]]:
    """The server's metrics once it is idle (nothing running, waiting or swapped), or at the deadline
    (False): its KV and swap blocks still used then are leaks, its descriptors should be back."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        m = await metrics(target)
        busy = sum(m.get(f"streamd_requests_{k}", 0.0) for k in ("running", "waiting", "swapped"))
        if not busy or time.monotonic() > deadline:
            return not busy, m
        await asyncio.sleep(0.5)  # polling a remote server's gauges: there is nothing to wait on


async def run_chaos(args: argparse.Namespace) -> dict[str, Any]:
    target, tally, rng = target_of(args), Tally(), random.Random(args.seed)
    _note_process(tally, await metrics(target), "before")
    start = time.monotonic()
    until = start + args.duration
    tasks = [control(target, tally, until), sample_process(target, tally, until)]
    if args.flood_sockets or args.body_holders:
        tasks.append(flood(target, tally, args, until))
    if args.long_prompt_tokens:
        tasks.append(long_prompt(target, tally, args.long_prompt_tokens, random.Random(rng.random())))
    tasks += [storm(target, tally, random.Random(rng.random()), until) for _ in range(args.storm_clients)]
    tasks += [fuzz(target, tally, random.Random(rng.random()), until) for _ in range(args.fuzzers)]
    tasks += [
        slow_reader(target, tally, until, responses) for _ in range(args.slow_readers) for responses in (False, True)
    ]
    tasks += [frame_flood(target, tally, until, bool(i % 2)) for i in range(args.flooders)]
    tasks += [schema_flood(target, tally, random.Random(rng.random()), until) for _ in range(args.schema_flooders)]
    if args.background_kills:
        tasks.append(_background(target, tally, args))
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - start
    idle, after = await idle_metrics(target)
    _note_process(tally, after, "after")
    return report(tally, elapsed, idle, after)


async def _background(target: Target, tally: Tally, args: argparse.Namespace) -> None:
    tally.background = await background_kills(
        target.http, target.headers, args.background_kills, args.background_concurrency, target.max_tokens, args.seed
    )


def report(tally: Tally, elapsed: float, idle: bool, after: dict[str, float]) -> dict[str, Any]:
    p99 = percentiles(tally.control_itl)["p99"]
    trivial = percentiles(tally.trivial_schema_waits)["p99"]
    return {
        "flood_frames": tally.flood_frames,
        "frame_flooders_closed": tally.flooders_closed,
        "duration_s": round(elapsed, 2),
        "requests": tally.requests,
        "tokens": tally.tokens,
        "errors_by_code": dict(sorted(tally.errors.items())),
        "unanswered_frames": tally.unanswered,
        "control_streams": tally.control_streams,
        "control_itl_p99_ms": round(p99 * 1000, 2) if p99 is not None else None,
        "trivial_schema_wait_p99_ms": round(trivial * 1000, 2) if trivial is not None else None,
        "control_itl_max_ms": round(max(tally.control_itl) * 1000, 2) if tally.control_itl else None,
        "long_prompt": dict(tally.long_prompt),
        "background_kills": dict(tally.background),
        "flood": dict(sorted(tally.flood.items())),
        **{k: round(v, 1) for k, v in sorted(tally.process.items())},
        "idle_after": idle,
        "leaked_kv_blocks": int(after.get("streamd_kv_blocks_used", 0.0)),
        "leaked_swap_blocks": int(after.get("streamd_swap_blocks_used", 0.0)),
    }


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run_chaos(args))
    width = max(len(k) for k in result)
    for key, value in result.items():
        print(f"{key:<{width}}  {value}")
    write_json(result, args.json)
    ok = result["idle_after"] and not result["leaked_kv_blocks"] and not result["leaked_swap_blocks"]
    return 0 if ok and not result["unanswered_frames"] and not bound_breaches(result, args) else 1


def bound_breaches(result: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What broke the run's bounds on the server's descriptors and memory, and on the flood's answers."""
    breaches = []
    if result["server_fds_max"] - result["server_fds_before"] > args.max_fd_growth:
        breaches.append(f"descriptors grew by more than {args.max_fd_growth}")
    if result["server_fds_after"] - result["server_fds_before"] > FD_SLACK:
        breaches.append("descriptors not given back once idle")
    if result["server_rss_mb_max"] - result["server_rss_mb_before"] > args.max_rss_growth_mb:
        breaches.append(f"resident memory grew by more than {args.max_rss_growth_mb} MB")
    if result["flood"].get("unanswered"):
        breaches.append("flood sockets closed without an answer")
    kills = result["background_kills"]
    if kills and kills["exact"] != kills["kills"]:
        breaches.append("background streams resumed wrong (a sequence number missing or twice, or other text)")
    return breaches
