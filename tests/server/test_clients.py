"""The load client (`streamd bench serve`) over both transports, and the `streamd chat` terminal client."""

from __future__ import annotations

import argparse
import asyncio
import sys

import pytest

from streamd.bench import load as bench
from streamd.bench import serve as bench_cli
from tests.server.util import Server


def bench_args(server: Server, **overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_cli.add_arguments(parser)
    args = parser.parse_args(["--url", server.http, "--num-requests", "6", "--max-tokens", "3",
                              "--prompt-words", "8"])
    vars(args).update(overrides)
    return args


async def test_bench_serve_over_websocket_and_sse(server: Server) -> None:
    for transport in ("ws", "sse"):
        args = bench_args(server, transport=transport, concurrency=3)
        timings, duration = await bench.run_load(args)
        result = bench.report(timings, duration, args)
        assert result["completed"] == 6 and result["failed"] == 0, result["errors"]
        assert result["output_tokens"] == 18
        for key in ("ttft_s", "e2e_s"):
            assert 0 < result[key]["p50"] <= result[key]["p90"] <= result[key]["p99"]
        # Tokens that reach the loop together travel in one frame (the collector merges them): ITL 0 is real.
        assert 0 <= result["itl_s"]["p50"] <= result["itl_s"]["p90"] <= result["itl_s"]["p99"]
        assert result["itl_s"]["p99"] > 0
        assert "TTFT" in bench.format_table(result)


async def test_bench_serve_sse_with_continuous_usage(server: Server) -> None:
    """Every chunk carries a usage then: each text chunk still counts as an arrival, the total is the final
    usage chunk's."""
    args = bench_args(server, transport="sse", concurrency=3, continuous_usage=True)
    timings, duration = await bench.run_load(args)
    result = bench.report(timings, duration, args)
    assert result["completed"] == 6 and result["output_tokens"] == 18, result["errors"]
    assert all(1 <= len(t.token_times) <= 3 for t in timings), [len(t.token_times) for t in timings]


async def test_bench_serve_poisson(server: Server) -> None:
    args = bench_args(server, transport="ws", rate=50.0, concurrency=None)
    timings, duration = await bench.run_load(args)
    result = bench.report(timings, duration, args)
    assert result["mode"] == "poisson" and result["completed"] == 6


def test_percentiles_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert bench.percentiles(values) == {"p50": 50.0, "p90": 90.0, "p99": 99.0, "mean": 50.5}
    assert bench.percentiles([])["p50"] is None


async def test_chat_cli_one_shot(server: Server) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamd.cli.main", "chat", "--url", server.ws, "--prompt", "Hello!",
        "--max-tokens", "5", "--temperature", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip()
    assert "TTFT" in err.decode() and "tok/s" in err.decode()


async def test_sse_client_survives_connections_the_server_closed_while_idle() -> None:
    """A server that closes every connection after its response (as uvicorn does to one idle past its
    keep-alive): each next request goes out on the closed connection (seen closed already, or failing as
    it is sent), and the client retries it on a fresh one, so none fails."""
    import orjson

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        length = next((int(line.split(":")[1]) for line in head.split("\r\n") if line.lower().startswith("content-length")), 0)
        await reader.readexactly(length)
        if head.startswith("GET"):
            body = orjson.dumps({"data": [{"id": "m"}]})
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        else:
            events = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
                      b'data: {"choices":[],"usage":{"completion_tokens":2}}\n\n', b"data: [DONE]\n\n"]
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"".join(
                b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")
        await writer.drain()
        writer.close()  # no "Connection: close": the client finds out only that it was closed

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with bench.SSEClient(f"http://127.0.0.1:{port}", None, None) as client:
            assert client.model == "m"
            for _ in range(3):  # each on the connection the server closed after the previous response
                timing = await client.generate("hi", 2)
                assert timing.error is None and timing.tokens == 2 and len(timing.token_times) == 2
    finally:
        server.close()
        await server.wait_closed()


async def test_websocket_pool_fails_requests_it_cannot_read_and_refuses_a_dead_socket() -> None:
    """A frame the pool cannot read fails its own request only; a message that is not JSON ends the socket's
    reader, which fails the requests on it, and a later request on that socket is refused instead of
    waiting forever."""
    import orjson
    from websockets.asyncio.server import serve

    async def handler(ws) -> None:
        async for raw in ws:
            request_id = orjson.loads(raw)["id"]
            if request_id == "b0":  # a delta without its token ids
                await ws.send(orjson.dumps([{"type": "delta", "id": "b0", "text": "x"}]).decode())
            elif request_id == "b1":
                await ws.send(orjson.dumps([{"type": "delta", "id": "b1", "token_ids": [1, 2], "text": "ab"},
                                            {"type": "done", "id": "b1", "finish_reason": "length"}]).decode())
            else:
                await ws.send("not json")

    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        async with bench.WebSocketPool(f"ws://127.0.0.1:{port}", 1, None) as pool:
            unreadable = await asyncio.wait_for(pool.generate("p", 2), 30)
            assert unreadable.error is not None and "unreadable frame" in unreadable.error
            fine = await asyncio.wait_for(pool.generate("p", 2), 30)
            assert fine.error is None and fine.tokens == 2
            ended = await asyncio.wait_for(pool.generate("p", 2), 30)
            assert ended.error == "the WebSocket closed"
            with pytest.raises(ConnectionError):
                await asyncio.wait_for(pool.generate("p", 2), 30)
