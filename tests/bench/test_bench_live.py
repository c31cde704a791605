"""`streamd bench live`: its light form runs the proxy scenario for real (null-model servers, nginx, the three
transports) at tiny sizes: keepalive on, every run whole after a prefill longer than the proxy's timeout;
off, every run cut. The full form runs all three scenarios at small sizes and checks each report's shape and
invariants (speed is not asserted: the committed results hold it)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from streamd.bench import live
from streamd.cli.cluster import nginx_binary
from tests.helpers import sizes

pytestmark = pytest.mark.skipif(not Path(nginx_binary()).exists(), reason="needs nginx (apt)")

PROXY = ["--scenarios", "proxy", "--prefill-s", "3", "--read-timeout-s", "1.5", "--gather-s", "0.8",
         "--keepalive-s", "0.25", "--ws-ping-s", "0.25", "--runs", "1"]
ALL = [*PROXY[:1], "proxy,first-frame,overhead", *PROXY[2:], "--max-num-seqs", "4", "--probes", "3",
       "--streams", "8", "--pairs", "1", "--max-tokens", "4", "--requests-per-stream", "1"]


def _args(argv: list[str], out: Path) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    live.add_arguments(parser)
    return parser.parse_args([*argv, "--out", str(out)])


@pytest.mark.parametrize("argv", sizes(PROXY, ALL))
def test_live_bench_reports_every_scenario(tmp_path: Path, argv: list[str]) -> None:
    args = _args(argv, tmp_path)
    code = live.run(args)
    (json_path,) = tmp_path.glob("live-*.json")
    report = json.loads(json_path.read_text())
    assert report["model"] == "null" and "transport, not tokens" in report["label"]
    rows = report["proxy"]["rows"]
    assert [(r["transport"], r["keepalive_s"] > 0) for r in rows] == [
        (t, on) for on in (True, False) for t in live.PROXY_TRANSPORTS]
    for row in rows:
        if row["keepalive_s"] > 0:  # whole, and its first token came after the proxy's idle timeout
            assert row["whole"] == row["runs"] == 1 and row["first_token_s_min"] > args.read_timeout_s, row
        else:  # the control: the proxy cut it
            assert row["whole"] == 0 and row["errors"], row
    assert "## proxy" in json_path.with_suffix(".md").read_text()
    if "overhead" not in report:
        assert code == 0
        return
    frames = report["first-frame"]["rows"]
    assert [r["transport"] for r in frames] == list(live.PROXY_TRANSPORTS)
    assert all(r["probes"] == 3 and 0 < r["first_frame_ms_p50"] <= r["first_frame_ms_p99"] for r in frames)
    assert all(r["queued"] == 3 for r in frames if r["transport"] != "chat")  # each waited behind the load
    pairs = report["overhead"]["pairs"]
    assert [p["transport"] for p in pairs] == ["sse", "ws"]
    assert all(p["on"] > 0 and p["off"] > 0 and p["ratio"] == round(p["on"] / p["off"], 3) for p in pairs)
    assert code == (0 if live.all_met(report) else 1)
