"""`streamd bench live`: issue 32's live-stream targets, measured against real servers and real sockets.

Every server here is the benchmark-only null model (null_model.py: real tokenizer, scheduler, KV blocks and
server, no forward pass), so what is measured is the transport, never tokens; each report says so.

- `proxy`: nginx with `proxy_read_timeout` (`--read-timeout-s`, 30) in front of a server whose prefill of a
  run's prompt (~300 tokens) takes `--prefill-s` (90) on the engine's thread (`prefill_s_per_token`), as a
  long prefill holds it. `--runs` streams per transport at once: chat completions SSE, `/v1/stream`
  (WebSocket) and Responses SSE. They are sent while a short "gate" request's prefill (`--gather-s`) holds
  the engine, so all are admitted together and prefill in one step (one sent during a 90 s step would wait
  for its admission, and so for its response's head, behind it: no keepalive covers a head not sent, and a
  real engine's steps are short chunks, not one 90 s step). A run is whole when
  its stream ends as its API says (`data: [DONE]` after a finish reason; a `done` frame; a terminal Responses
  event with every `sequence_number` once). The control rows are the same with `server.sse_keepalive_s` and
  `server.ws_ping_interval_s` 0 (no keepalive comments, no WebSocket pings).
- `first-frame`: a server whose `max_num_seqs` streams are all busy (a `streamd bench serve` subprocess keeps
  more streams than that in flight), and `--probes` requests per transport queued behind them: the time from
  writing each request to reading its first frame (`start`, the role chunk, `response.created`) and its first
  progress (`progress`, `response.queued`). The clock starts before the server admits the request (it also
  holds parsing and tokenizing), so these are upper bounds of admission to first frame.
- `overhead`: served output tok/s at `--streams` streams (`streamd bench serve`'s client, SSE and WebSocket)
  against two servers: "on" (progress reports, `server.sse_keepalive_s` 15, `continuous_usage_stats` asked
  by the SSE client) and "off" (none of them), `--pairs` pairs alternating which goes first; the ratio is
  on/off per pair, and its median is reported, beside the server process's CPU time per token (off/on),
  which the box's contention moves less than a wall-clock rate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamd.bench.report import NULL_MODEL, BenchError, add_out_argument, markdown_table, report_header, save_report
from streamd.bench.serve_baseline import DEFAULT_SETTINGS, served_run

if TYPE_CHECKING:
    from streamd.bench.serve_baseline import ServerProcess

SCENARIOS = ("proxy", "first-frame", "overhead")
PROXY_TRANSPORTS = ("chat", "ws", "responses")
NULL_LABEL = (
    "null model (benchmark-only: no forward pass; proxy: a prefill step sleeps per token of its longest prompt, "
    "a run's ~300 tokens take --prefill-s): this measures the transport, not tokens"
)
# The proxy's server: every run's prompt in one step, unchunked (the step's sleep is its longest prompt's).
PROXY_SETTINGS = ("scheduler.max_num_batched_tokens=65536", "scheduler.max_step_ms=0")
RUN_PROMPT_TOKENS = 300  # about a run's prompt (`_prompt`), chat template included


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated: " + ", ".join(SCENARIOS))
    proxy = parser.add_argument_group("proxy")
    proxy.add_argument("--prefill-s", type=float, default=90.0, help="seconds each prefill step holds the engine")
    proxy.add_argument("--read-timeout-s", type=float, default=30.0, help="nginx's proxy_read_timeout")
    proxy.add_argument("--keepalive-s", type=float, default=15.0, help="server.sse_keepalive_s of the 'on' rows")
    proxy.add_argument("--ws-ping-s", type=float, default=20.0, help="server.ws_ping_interval_s of the 'on' rows")
    proxy.add_argument("--runs", type=int, default=20, help="streams per transport, all at once")
    proxy.add_argument("--gather-s", type=float, default=20.0, help="the gate's prefill, while the runs arrive")
    proxy.add_argument("--transports", default=",".join(PROXY_TRANSPORTS), help="of: " + ", ".join(PROXY_TRANSPORTS))
    first = parser.add_argument_group("first-frame")
    first.add_argument("--max-num-seqs", type=int, default=64, help="the saturated server's running streams")
    first.add_argument("--probes", type=int, default=100, help="queued requests per transport")
    overhead = parser.add_argument_group("overhead")
    overhead.add_argument("--streams", type=int, default=256)
    overhead.add_argument("--pairs", type=int, default=3)
    overhead.add_argument("--max-tokens", type=int, default=64)
    overhead.add_argument("--requests-per-stream", type=int, default=2)
    overhead.add_argument(
        "--model", default=NULL_MODEL, help="a real model for both servers (default: the null model, the worst case)"
    )
    overhead.add_argument("--layout", choices=("thread", "process", "split"), default="thread")
    overhead.add_argument("--overhead-transports", default="sse,ws", help="of: sse, ws")
    overhead.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="both servers' settings")
    add_out_argument(parser)


def run(args: argparse.Namespace) -> int:
    scenarios = args.scenarios.split(",")
    if unknown := set(scenarios) - set(SCENARIOS):
        raise BenchError(f"unknown scenarios {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    report: dict[str, Any] = {**report_header(_device(args)), **_model(args), "argv": sys.argv[1:]}
    for name in scenarios:
        report[name] = asyncio.run(SCENARIO_RUNS[name](args))
        print(json.dumps({name: report[name]}, indent=1, default=str), flush=True)
    stem = save_report(report, args.out, "-".join(["live", *scenarios]), markdown(report))
    print(f"wrote {stem}.json and .md")
    return 0 if all_met(report) else 1


def _model(args: argparse.Namespace) -> dict[str, str]:
    """The report's model and label: only the overhead scenario takes a real model."""
    model = args.model
    if model == NULL_MODEL or "overhead" not in args.scenarios.split(","):
        return {"model": NULL_MODEL, "label": NULL_LABEL}
    return {"model": model, "label": f"{model} (real forward passes; overhead only), layout {args.layout}"}


def _device(args: argparse.Namespace) -> str:
    """Where a real model's servers run (the null model's always on the CPU)."""
    if _model(args)["model"] == NULL_MODEL:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---- servers and the proxy -------------------------------------------------------------------------------
@contextlib.contextmanager
def bench_server(
    settings: list[str], extra: list[str], model: str = NULL_MODEL, layout: str = "thread"
) -> Iterator[ServerProcess]:
    """A `streamd bench serve_target` process (the real server path, its CPU time readable): the null model
    unless `model` names another."""
    from streamd.bench.serve_baseline import ServerProcess

    server = ServerProcess(model, [*DEFAULT_SETTINGS, *settings], layout, extra)
    try:
        yield server
    finally:
        server.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proxy_config(port: int, upstream_port: int, read_timeout_ms: int) -> str:
    """nginx's `http` block: everything to the server, SSE unbuffered, WebSockets upgraded, one read timeout."""
    return f"""\
    client_body_buffer_size 1m;  # bodies stay in memory (the worker may not write the workdir)
    map $http_upgrade $connection_upgrade {{
        default upgrade;
        "" close;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://127.0.0.1:{upstream_port};
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection $connection_upgrade;
            proxy_buffering off;
            proxy_read_timeout {read_timeout_ms}ms;
        }}
    }}
"""


@contextlib.contextmanager
def nginx_in_front(upstream_url: str, read_timeout_s: float) -> Iterator[str]:
    """nginx on a free port in front of `upstream_url` (`proxy_config`); its base URL while it runs."""
    from streamd.cli.cluster import nginx_binary, nginx_conf

    workdir, port = Path(tempfile.mkdtemp(prefix="streamd-live-")), free_port()
    upstream_port = int(upstream_url.rsplit(":", 1)[1])
    http = proxy_config(port, upstream_port, round(read_timeout_s * 1000))
    (workdir / "nginx.conf").write_text(nginx_conf(workdir, http))
    process = subprocess.Popen(
        [nginx_binary(), "-c", str(workdir / "nginx.conf"), "-p", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_listening(port, process)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=30)
        shutil.rmtree(workdir, ignore_errors=True)


def _wait_listening(port: int, process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                raise BenchError("nginx did not start (is it installed? `apt-get install nginx-light`)") from None
            time.sleep(0.05)  # a process starting: nothing to wait on but its port


# ---- proxy ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class ProxyRun:
    whole: bool = False
    first_token_s: float | None = None  # from the request to its first text
    error: str | None = None


async def proxy(args: argparse.Namespace) -> dict[str, Any]:
    """The keepalive-on rows and the control's (keepalive off), their servers and proxies side by side."""
    transports = args.transports.split(",")
    on, off = await asyncio.gather(
        asyncio.to_thread(_proxy_rows, args, transports, args.keepalive_s, args.ws_ping_s),
        asyncio.to_thread(_proxy_rows, args, transports, 0.0, 0.0),
    )
    return {
        "prefill_s": args.prefill_s,
        "read_timeout_s": args.read_timeout_s,
        "runs_per_transport": args.runs,
        "rows": on + off,
    }


def _proxy_rows(
    args: argparse.Namespace, transports: list[str], keepalive_s: float, ws_ping_s: float
) -> list[dict[str, Any]]:
    settings = [f"server.sse_keepalive_s={keepalive_s}", f"server.ws_ping_interval_s={ws_ping_s}", *PROXY_SETTINGS]
    rate = args.prefill_s / RUN_PROMPT_TOKENS
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(bench_server(settings, ["--prefill-s-per-token", str(rate)])).url
        front = stack.enter_context(nginx_in_front(url, args.read_timeout_s))
        gate_tokens = round(args.gather_s / rate)
        return asyncio.run(_proxy_all(url, front, transports, args.runs, (keepalive_s, ws_ping_s), gate_tokens))


async def _proxy_all(
    url: str, front: str, transports: list[str], runs: int, keepalive: tuple[float, float], gate_tokens: int
) -> list[dict[str, Any]]:
    """The runs, sent while the gate's prefill holds the engine; `keepalive`: (SSE comment, WS ping) seconds."""
    import httpx

    clients = {"chat": _chat_run, "ws": _ws_run, "responses": _responses_run}
    async with httpx.AsyncClient(base_url=url, timeout=None) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        # A streamed chat's role chunk goes out at admission, right before the gate's prefill step begins.
        async with http.stream("POST", "/v1/chat/completions", json=_gate_body(gate_tokens, model)) as gate:
            gate.raise_for_status()
            lines = gate.aiter_lines()
            while not (await anext(lines)).startswith("data: "):
                pass
            results = await asyncio.gather(*(clients[t](front, model) for t in transports for _ in range(runs)))
            async for _ in lines:  # the gate's end
                pass
    keepalive_s, ws_ping_s = keepalive
    return [
        _proxy_row(t, ws_ping_s if t == "ws" else keepalive_s, results[i * runs : (i + 1) * runs])
        for i, t in enumerate(transports)
    ]


def _proxy_row(transport: str, keepalive_s: float, runs: list[ProxyRun]) -> dict[str, Any]:
    """`keepalive_s`: the transport's (`server.sse_keepalive_s`, or `server.ws_ping_interval_s` for "ws")."""
    firsts = [r.first_token_s for r in runs if r.first_token_s is not None]
    errors = sorted({r.error for r in runs if r.error})
    return {
        "transport": transport,
        "keepalive_s": keepalive_s,
        "runs": len(runs),
        "whole": sum(r.whole for r in runs),
        "first_token_s_min": round(min(firsts), 1) if firsts else None,
        "first_token_s_max": round(max(firsts), 1) if firsts else None,
        "errors": errors[:3],
    }


def _prompt(tokens: int = 12) -> str:
    """A new prompt (no prefix cache hit) of about `tokens` tokens (~6 a sentence)."""
    return f"{uuid.uuid4().hex}. " + " ".join(f"item {i} is blue." for i in range(max(1, tokens // 6)))


def _gate_body(tokens: int, model: str) -> dict[str, Any]:
    """A chat of about `tokens` tokens, its template's ~30 included."""
    return {
        "messages": [{"role": "user", "content": _prompt(tokens - 30)}],
        "max_tokens": 1,
        "model": model,
        "stream": True,
    }


def _gauge(metrics: str, name: str) -> float:
    return sum(float(line.split()[1]) for line in metrics.splitlines() if line.startswith(f"{name} "))


async def _sse_run(url: str, body: dict[str, Any], is_token: Callable[[str], bool]) -> tuple[ProxyRun, list[str]]:
    """POSTs `body` and reads the SSE answer's lines, timing the first line `is_token` accepts; a status
    other than 200 or a transport error is the run's error."""
    import httpx

    run, lines = ProxyRun(), []
    try:
        async with httpx.AsyncClient(timeout=None) as http:
            began = time.monotonic()
            async with http.stream("POST", url, json=body) as answer:
                if answer.status_code != 200:
                    run.error = f"HTTP {answer.status_code}: {(await answer.aread())[:120]!r}"
                async for line in answer.aiter_lines():
                    if run.first_token_s is None and is_token(line):
                        run.first_token_s = time.monotonic() - began
                    lines.append(line)
    except httpx.HTTPError as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    return run, lines


def _is_content(line: str) -> bool:
    return '"content":"' in line and '"content":""' not in line


async def _chat_run(front: str, model: str) -> ProxyRun:
    content = _prompt(RUN_PROMPT_TOKENS - 30)
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": True, "model": model}
    run, lines = await _sse_run(f"{front}/v1/chat/completions", body, _is_content)
    finished = any('"finish_reason":"' in line for line in lines)
    run.whole = run.error is None and finished and "data: [DONE]" in lines
    return run


async def _responses_run(front: str, model: str) -> ProxyRun:
    body = {"input": _prompt(RUN_PROMPT_TOKENS - 30), "max_output_tokens": 4, "stream": True, "model": model}
    run, lines = await _sse_run(f"{front}/v1/responses", body, lambda line: '"response.output_text.delta"' in line)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    in_order = [e.get("sequence_number") for e in events] == list(range(len(events)))
    ended = bool(events) and events[-1]["type"] in ("response.completed", "response.incomplete")
    run.whole = run.error is None and in_order and ended
    return run


async def _ws_run(front: str, model: str) -> ProxyRun:
    from websockets.asyncio.client import connect
    from websockets.exceptions import WebSocketException
    from websockets.typing import Subprotocol

    url = front.replace("http://", "ws://") + "/v1/stream"
    run = ProxyRun()
    try:
        # No client pings (a browser sends none): only the server's may keep the proxy from cutting it.
        async with connect(url, subprotocols=[Subprotocol("streamd.v1")], open_timeout=60, ping_interval=None) as ws:
            began = time.monotonic()
            generate = {
                "type": "generate",
                "id": "r",
                "prompt": _prompt(RUN_PROMPT_TOKENS),
                "params": {"max_tokens": 4},
            }
            await ws.send(json.dumps(generate))
            while True:
                frame = json.loads(await ws.recv())
                if frame["type"] == "delta" and run.first_token_s is None:
                    run.first_token_s = time.monotonic() - began
                if frame["type"] in ("done", "error"):
                    run.whole = frame["type"] == "done" and frame["finish_reason"] in ("stop", "length")
                    return run
    except (WebSocketException, OSError) as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    return run


# ---- first frame -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Probe:
    first_frame_ms: list[float] = field(default_factory=list)
    first_progress_ms: list[float] = field(default_factory=list)
    queued_at_first_frame: int = 0  # probes whose progress said they waited in the queue
    errors: list[str] = field(default_factory=list)


async def first_frame(args: argparse.Namespace) -> dict[str, Any]:
    """Probes per transport queued behind a saturated server (module docstring)."""
    settings = [f"scheduler.max_num_seqs={args.max_num_seqs}"]
    with bench_server(settings, []) as server:
        url = server.url
        load = _saturate(url, args.max_num_seqs * 3 // 2)
        try:
            model = await _until_queued(url)
            probes = {t: await _probe_all(url, model, t, args.probes) for t in PROXY_TRANSPORTS}
        finally:
            load.terminate()
            load.wait(60)
    return {
        "max_num_seqs": args.max_num_seqs,
        "streams_in_flight": args.max_num_seqs * 3 // 2,
        "rows": [_probe_row(t, p) for t, p in probes.items()],
    }


def _saturate(url: str, streams: int) -> subprocess.Popen[bytes]:
    """More WebSocket streams than the server runs at once, long enough to outlast the probes."""
    command = [sys.executable, "-m", "streamd.cli", "bench", "serve", "--url", url, "--transport", "ws"]
    command += ["--concurrency", str(streams), "--num-requests", str(streams * 4), "--max-tokens", "4000"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _until_queued(url: str, timeout_s: float = 120.0) -> str:
    """Polls /metrics until requests wait in the queue (the engine is saturated); the server's model name."""
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient() as http:
        while time.monotonic() < deadline:
            if _gauge((await http.get(f"{url}/metrics")).text, "streamd_requests_waiting") > 0:
                return str((await http.get(f"{url}/v1/models")).json()["data"][0]["id"])
            await asyncio.sleep(0.2)  # a remote server's gauge: nothing to wait on
    raise BenchError("the load never saturated the server (no request waiting)")


async def _probe_all(url: str, model: str, transport: str, count: int) -> Probe:
    """`count` probes one after another (each queued behind the load; it leaves after its first progress)."""
    probe = Probe()
    one = _ws_probe if transport == "ws" else _sse_probe(transport)
    for _ in range(count):
        try:
            await asyncio.wait_for(one(url, model, probe), 60)
        except (OSError, TimeoutError, ValueError) as exc:
            probe.errors.append(f"{type(exc).__name__}: {exc}")
    return probe


def _sse_probe(transport: str) -> Callable[[str, str, Probe], Coroutine[Any, Any, None]]:
    path, progress_type = ("/v1/chat/completions", None) if transport == "chat" else ("/v1/responses", "queued")

    async def probe_once(url: str, model: str, probe: Probe) -> None:
        host, port = url.removeprefix("http://").split(":")
        fields = (
            {"messages": [{"role": "user", "content": _prompt()}], "max_tokens": 16}
            if transport == "chat"
            else {"input": _prompt(), "max_output_tokens": 16}
        )
        body = json.dumps({**fields, "model": model, "stream": True}).encode()
        head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        request = f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            sent = time.perf_counter()
            writer.write(request)
            await _read_sse(reader, sent, probe, progress_type)
        finally:
            writer.close()

    return probe_once


async def _read_sse(reader: asyncio.StreamReader, sent: float, probe: Probe, progress_type: str | None) -> None:
    """Reads until the first `data:` event (chat) or the first `response.queued`/`in_progress` (Responses)."""
    first = False
    while line := await reader.readline():
        if not line.startswith(b"data: "):
            continue
        ms = (time.perf_counter() - sent) * 1000
        if not first:
            probe.first_frame_ms.append(ms)
            first = True
        if progress_type is None:
            return
        kind = json.loads(line[6:])["type"]
        if kind in ("response.queued", "response.in_progress"):
            probe.first_progress_ms.append(ms)
            probe.queued_at_first_frame += kind == "response.queued"
            return
    raise ValueError("the stream ended before its first frame")


async def _ws_probe(url: str, model: str, probe: Probe) -> None:
    from websockets.asyncio.client import connect
    from websockets.typing import Subprotocol

    ws_url = url.replace("http://", "ws://") + "/v1/stream"
    generate = {"type": "generate", "id": "p", "prompt": _prompt(), "params": {"max_tokens": 16}}
    async with connect(ws_url, subprotocols=[Subprotocol("streamd.v1")], ping_interval=None) as ws:
        sent = time.perf_counter()
        await ws.send(json.dumps(generate))
        frame = json.loads(await ws.recv())  # `start`, at admission
        probe.first_frame_ms.append((time.perf_counter() - sent) * 1000)
        while frame["type"] not in ("progress", "delta", "done", "error"):
            frame = json.loads(await ws.recv())
        probe.first_progress_ms.append((time.perf_counter() - sent) * 1000)
        probe.queued_at_first_frame += frame.get("queue_position") is not None


def _probe_row(transport: str, probe: Probe) -> dict[str, Any]:
    from streamd.bench.load import percentiles

    def ms(values: list[float], q: str) -> float | None:
        value = percentiles(values)[q]
        return None if value is None else round(value, 1)

    return {
        "transport": transport,
        "probes": len(probe.first_frame_ms),
        "queued": probe.queued_at_first_frame,
        "first_frame_ms_p50": ms(probe.first_frame_ms, "p50"),
        "first_frame_ms_p99": ms(probe.first_frame_ms, "p99"),
        "first_progress_ms_p50": ms(probe.first_progress_ms, "p50"),
        "first_progress_ms_p99": ms(probe.first_progress_ms, "p99"),
        "errors": probe.errors[:3],
    }


# ---- overhead ----------------------------------------------------------------------------------------------
async def overhead(args: argparse.Namespace) -> dict[str, Any]:
    """Served tok/s with the live-stream features on vs off, pairs alternating which runs first."""
    return await asyncio.to_thread(_overhead, args)


def _overhead(args: argparse.Namespace) -> dict[str, Any]:
    """A quarter of the streams wait in the queue (seats for three quarters), so the "on" server reports queue
    places and every chunk carries usage; its keepalive stays quiet while tokens flow, as it should. Each pair
    starts its own two servers (in alternating order): two processes of one configuration differed by up to a third
    in CPU per token for as long as they lived (an A/A run on the CPU: benchmarks/NOTES.md), so servers kept for
    every pair would carry their own bias into every ratio."""
    transports = args.overhead_transports.split(",")
    if unknown := set(transports) - {"sse", "ws"}:
        raise BenchError(f"--overhead-transports: unknown {sorted(unknown)}; known: sse, ws")
    rows: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        with contextlib.ExitStack() as stack:
            servers = _overhead_servers(args, stack, first="on" if pair % 2 == 0 else "off")
            for transport in transports:
                order = ("on", "off") if pair % 2 == 0 else ("off", "on")
                runs = {side: _served(args, servers[side], transport, side == "on", pair) for side in order}
                rows.append(_overhead_row(pair, transport, runs))
                print(rows[-1], flush=True)
    return {
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "pairs": rows,
        "median_ratio": _medians(rows, "ratio"),
        "median_cpu_ratio": _medians(rows, "cpu_ratio"),
    }


def _overhead_servers(args: argparse.Namespace, stack: contextlib.ExitStack, first: str) -> dict[str, ServerProcess]:
    """The "on" server (progress reports, SSE keepalive) and the "off" one (neither, no WebSocket pings), the
    `first` started first."""
    base = [*args.set, f"scheduler.max_num_seqs={max(1, args.streams * 3 // 4)}"]
    configs = {
        "on": ([*base, "server.sse_keepalive_s=15"], []),
        "off": ([*base, "server.sse_keepalive_s=0", "server.ws_ping_interval_s=0"], ["--no-progress"]),
    }
    sides = [first, *(side for side in configs if side != first)]
    return {side: stack.enter_context(bench_server(*configs[side], args.model, args.layout)) for side in sides}


def _overhead_row(pair: int, transport: str, runs: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """tok/s on/off (`ratio`) and the server's CPU µs per token off/on (`cpu_ratio`: below 1, "on" costs more)."""
    (on, on_us), (off, off_us) = runs["on"], runs["off"]
    cpu = {"on_cpu_us_per_token": on_us, "off_cpu_us_per_token": off_us, "cpu_ratio": round(off_us / on_us, 3)}
    return {"pair": pair, "transport": transport, "on": on, "off": off, "ratio": round(on / off, 3), **cpu}


def _medians(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    transports = dict.fromkeys(r["transport"] for r in rows)
    return {t: statistics.median(r[key] for r in rows if r["transport"] == t) for t in transports}


def _served(
    args: argparse.Namespace, server: ServerProcess, transport: str, on: bool, pair: int
) -> tuple[float, float]:
    """One closed-loop run (`bench serve`'s): output tok/s and the server process's CPU µs per output token."""
    from streamd.bench import serve
    from streamd.server.serve import run_on_uvloop

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    load_args = parser.parse_args(["--max-tokens", str(args.max_tokens)])
    load_args.continuous_usage = on
    runs = args.streams * args.requests_per_stream
    result, cpu, _ = run_on_uvloop(served_run(load_args, server, transport, args.streams, runs, 1000 + pair))
    if result["failed"]:
        raise BenchError(f"served run failed: {result['errors']}")
    tokens = max(1, result["output_tokens"])
    return round(float(result["output_token_throughput"]), 1), round(cpu["process"] / tokens * 1e6, 1)


SCENARIO_RUNS: dict[str, Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]]] = {
    "proxy": proxy,
    "first-frame": first_frame,
    "overhead": overhead,
}


# ---- the report ----------------------------------------------------------------------------------------------
def all_met(report: dict[str, Any]) -> bool:
    """The targets: every keepalive-on proxy run whole; first frames under 100 ms p99; on/off >= 0.99."""
    met = True
    if "proxy" in report:
        met &= all(r["whole"] == r["runs"] for r in report["proxy"]["rows"] if r["keepalive_s"] > 0)
    if "first-frame" in report:
        met &= all((r["first_frame_ms_p99"] or 1e9) < 100 for r in report["first-frame"]["rows"])
    if "overhead" in report:
        met &= all(v >= 0.99 for v in report["overhead"]["median_ratio"].values())
    return bool(met)


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# streamd bench live ({report['date']}, {report['device']}, commit {report['git_commit']})",
        "",
        f"`streamd {' '.join(report['argv'])}`. Model: {report['label']}.",
        "",
    ]
    if "proxy" in report:
        p = report["proxy"]
        lines += [f"## proxy: nginx `proxy_read_timeout {p['read_timeout_s']}s`, prefill {p['prefill_s']} s", ""]
        header: tuple[str, ...] = (
            "transport",
            "keepalive s (SSE comment / WS ping)",
            "runs",
            "whole",
            "first token s",
            "errors",
        )
        rows: list[tuple[Any, ...]] = [
            (r["transport"], r["keepalive_s"], r["runs"], r["whole"],
             f"{r['first_token_s_min']}-{r['first_token_s_max']}", "; ".join(r["errors"]) or "-")
            for r in p["rows"]
        ]  # fmt: skip
        lines += [*markdown_table(header, rows), ""]
    if "first-frame" in report:
        f = report["first-frame"]
        lines += [
            f"## first frame, queued behind {f['max_num_seqs']} busy streams ({f['streams_in_flight']} in flight)"
        ]
        header = ("transport", "probes", "queued", "first frame ms p50", "p99", "first progress ms p50", "p99")
        rows = [
            (r["transport"], r["probes"], r["queued"], r["first_frame_ms_p50"], r["first_frame_ms_p99"],
             r["first_progress_ms_p50"], r["first_progress_ms_p99"])
            for r in f["rows"]
        ]  # fmt: skip
        lines += ["", *markdown_table(header, rows), ""]
    if "overhead" in report:
        o = report["overhead"]
        lines += [f"## served tok/s at {o['streams']} streams, live-stream features on vs off", ""]
        header = ("pair", "transport", "on tok/s", "off tok/s", "on/off", "on CPU µs/tok", "off CPU µs/tok", "off/on")
        rows = [
            (r["pair"], r["transport"], r["on"], r["off"], r["ratio"], r["on_cpu_us_per_token"],
             r["off_cpu_us_per_token"], r["cpu_ratio"])
            for r in o["pairs"]
        ]  # fmt: skip
        lines += [*markdown_table(header, rows), "", f"Median tok/s on/off: {o['median_ratio']}"]
        lines += [f"Median server CPU per token off/on: {o['median_cpu_ratio']}", ""]
    return "\n".join(lines)
