"""`streamd bench chaos` against a live server for a few seconds: it reports every scenario's traffic,
finds the server idle with no leaked block afterwards, every fuzz frame answered, and the server's file
descriptors and memory within their bounds (flooders and slow readers on both WebSocket routes)."""

from __future__ import annotations

import argparse

from streamd.bench import chaos
from tests.server.util import Server


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
    assert result["fds_within_bound"] and result["rss_within_bound"], result
    assert result["server_fds_before"] > 0 and result["server_rss_mb_after"] > 0
    assert result["trivial_schema_wait_p99_ms"] is not None  # the schema flood ran, and its trivial schemas came
    assert result["errors_by_code"]["invalid_request"] >= 1  # (the over-budget schemas among them)
