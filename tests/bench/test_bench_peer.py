"""`streamd bench peer`'s runs against live servers (two in-process servers on the session's engine, standing
for the peer and streamd): every level and round runs on both, in alternating order, with the requested
output per request, and the report's medians and ratios are those of its runs."""

from __future__ import annotations

import argparse
import statistics

import pytest

from streamd.bench import peer
from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import running_server

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the session's engine delivers to the session's loop


async def test_peer_bench_runs_both_servers_alternating_and_reports_their_ratio(async_engine: AsyncEngine) -> None:
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    args = parser.parse_args(["--url", "unused", "--concurrency", "1,2", "--rounds", "2", "--max-tokens", "3",
                              "--prompt-words", "6", "--requests-per-stream", "1"])
    async with running_server(async_engine) as theirs, running_server(async_engine) as ours:
        runs = await peer._all_runs({"peer": theirs.http, "streamd": ours.http}, [1, 2], args)
        await async_engine.wait_idle()
    firsts = [runs[i].server for i in range(0, len(runs), 2)]
    assert firsts == ["peer", "streamd", "streamd", "peer"]  # (round + level) parity decides who goes first
    assert all(r.failed == 0 and r.completed == r.concurrency for r in runs)
    assert all(r.output_tok_s > 0 and r.ttft_p50_s for r in runs)
    assert all(r.itl_p50_s is not None and r.itl_p50_s > 0 for r in runs)  # 3 tokens: two gaps a request
    for level in map(lambda c: peer._level(runs, c), (1, 2)):
        for name in ("streamd", "peer"):
            rates = [r.output_tok_s for r in runs if r.concurrency == level["concurrency"] and r.server == name]
            assert level[f"{name}_tok_s"] == statistics.median(rates)
            itls = [r.itl_p50_s for r in runs if r.concurrency == level["concurrency"] and r.server == name]
            assert level[f"{name}_itl_p50_s"] == statistics.median(itls)
        assert level["tok_s_ratio"] == pytest.approx(level["streamd_tok_s"] / level["peer_tok_s"])
    report = {"date": "d", "git_commit": "c", "device": "cpu", "peer_url": "u", "argv": ["peer"],
              "levels": [peer._level(runs, 1)]}
    assert "| streams | streamd tok/s | peer tok/s | streamd/peer |" in peer.markdown(report)
    assert "| ITL p50 streamd | ITL p50 peer |" in peer.markdown(report)


async def test_streamd_runs_in_streamd_serves_own_layout(monkeypatch) -> None:
    """The peer bench starts streamd as `streamd serve` runs it (`--layout auto`: `engine.process` as configured,
    the engine in its own process by default), not on the server's thread (`thread`, serve_target's default)."""
    from streamd.bench import serve_baseline, serve_target

    started: list[tuple[list[str], str]] = []

    class Started:
        url = "http://127.0.0.1:1"

        def __init__(self, model: str, settings: list[str], layout: str = "thread") -> None:
            started.append((settings, layout))

        def stop(self) -> None:
            pass

    monkeypatch.setattr(serve_baseline, "ServerProcess", Started)
    parser = argparse.ArgumentParser()
    peer.add_arguments(parser)
    with peer._streamd(parser.parse_args(["--url", "unused", "--set", "model.num_threads=1"])) as url:
        assert url == Started.url
    assert started == [(["model.num_threads=1"], "auto")]
    assert serve_target.build_config("null", [], "auto").engine.process == "auto"  # as configured
    assert serve_target.build_config("null", ["engine.process=false"], "auto").engine.process is False
    assert serve_target.build_config("null", [], "thread").engine.process is False
