"""`streamd bench chaos` against a live server for a few seconds: it reports every scenario's traffic,
finds the server idle with no leaked block afterwards, every fuzz frame answered, and the server's file
descriptors and memory within their bounds (flooders and slow readers on both WebSocket routes)."""

from __future__ import annotations

import argparse

import httpx

from streamd.bench import chaos
from streamd.engine.client.async_engine import AsyncEngine
from tests.reliability.util import LIMITS, settle
from tests.server.util import Server, running_server


async def test_chaos_bench_reports_a_clean_run(rserver: Server) -> None:
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    args = parser.parse_args(["--url", rserver.http, "--duration", "6", "--storm-clients", "3",
                              "--max-tokens", "8", "--seed", "3"])
    result = await chaos.run_chaos(args)
    assert result["idle_after"] and result["leaked_kv_blocks"] == 0 and result["leaked_swap_blocks"] == 0
    assert result["unanswered_frames"] == 0, result
    assert result["requests"] > 0 and result["tokens"] > 0 and result["control_streams"] >= 1
    assert result["control_itl_p99_ms"] is not None
    assert "invalid_json" in result["errors_by_code"]
    assert result["flood_frames"] > 0
    assert chaos.bound_breaches(result, args) == [], result
    assert result["server_fds_before"] > 0 and result["server_rss_mb_after"] > 0
    # (the schema flood's trivial-schema wait is reported once a whole batch is answered: its heavy schemas may
    # outlast a 6-second run on a loaded machine, so only the refusals of the over-budget ones are asserted)
    assert result["errors_by_code"]["invalid_request"] >= 1  # (the over-budget schemas among them)


async def test_chaos_bench_floods_within_the_servers_bounds(async_engine: AsyncEngine) -> None:
    """Silent sockets and held bodies from another address against a server with small caps: each gets its
    503 or 408, the control stream and a long prompt run beside them, and the bench's bounds on the server's
    descriptors and memory hold (client and server share this process: its descriptors count both). The
    engine generates once before the run, as `streamd serve` warms up before it is ready: a cold engine's
    first generation adds ~580 MB of resident memory (kernels, allocator pools), which is no growth of the
    server's; warm, the run adds a few MB, and the bound stays tight enough to catch held bodies or sockets."""
    caps = {"max_open_connections": 24, "max_connections_per_client": 8, "header_timeout_s": 1.0,
            "body_timeout_s": 1.0, "max_pending_body_bytes": 100_000}
    async with running_server(async_engine, **{**LIMITS, **caps}) as server:
        await _generate_once(server, prompt_words=300)
        parser = argparse.ArgumentParser()
        chaos.add_arguments(parser)
        args = parser.parse_args(["--url", server.http, "--duration", "8", "--storm-clients", "1", "--fuzzers", "0",
                                  "--slow-readers", "0", "--flooders", "0", "--schema-flooders", "0",
                                  "--max-tokens", "8", "--flood-sockets", "60",
                                  "--body-holders", "4", "--body-bytes", "60000", "--long-prompt-tokens", "300",
                                  "--max-rss-growth-mb", "100"])
        result = await chaos.run_chaos(args)
        await settle(server)
    assert chaos.bound_breaches(result, args) == [], result
    assert set(result["flood"]) <= {"503", "408"} and sum(result["flood"].values()) == 64, result
    assert result["flood"]["503"] >= 60 - 8 and result["flood"].get("408", 0) >= 1
    assert result["long_prompt"]["prompt_tokens"] > 250 and result["long_prompt"]["ttft_s"] > 0
    assert result["control_itl_max_ms"] is not None and result["server_fds_max"] > 0


async def _generate_once(server: Server, prompt_words: int) -> None:
    """One completion as long as the run's long prompt, so the engine's first-use allocations come before
    the run's memory window."""
    async with httpx.AsyncClient(base_url=server.http, timeout=120) as http:
        answer = await http.post("/v1/completions", json={"prompt": "the cat " * (prompt_words // 2), "max_tokens": 8})
    assert answer.status_code == 200, answer.text
