"""The load client (`streamd bench serve`) over both transports, and the `streamd chat` terminal client."""

from __future__ import annotations

import argparse
import asyncio
import sys

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
        sys.executable, "-m", "streamd.cli", "chat", "--url", server.ws, "--prompt", "Hello!",
        "--max-tokens", "5", "--temperature", "0",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    assert out.decode().strip()
    assert "TTFT" in err.decode() and "tok/s" in err.decode()
