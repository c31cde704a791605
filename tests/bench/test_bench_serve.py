"""`streamd bench serve --offline-baseline` end to end at a tiny size: its own servers (the
engine on a thread; in the full (slow) run also in its own process, making deltas in the server process and
there), the offline rate, WebSocket and SSE clients, and the report in the schema issue 9 asks for. The null model runs here because this tests the benchmark, not outputs. Also the `--json` writer that
`bench serve` and `bench chaos` share."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from streamd.bench.report import write_json
from tests.helpers import sizes

RUN_FIELDS = {"transport", "concurrency", "offline_tok_s", "served_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
              "itl_p99_s", "server_cpu_us_per_token", "client_cpu_us_per_token"}


# Light: the engine in the server's process; full (slow): in its own process too (split, process).
@pytest.mark.parametrize("layouts", sizes(("thread",), ("thread", "process", "split")))
def test_offline_baseline_writes_the_report(tmp_path: Path, layouts: tuple[str, ...]) -> None:
    command = [sys.executable, "-m", "streamd.cli.main", "bench", "serve", "--offline-baseline", "--levels", "4",
               "--repeats", "1", "--requests-per-stream", "2", "--max-tokens", "6", "--prompt-words", "8",
               "--layouts", ",".join(layouts), "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp_path.glob("serve-*.json")
    report = json.loads(path.read_text())
    assert report["model"] == "null" and report["git_commit"] and report["device"]
    assert {(r["transport"], r["layout"]) for r in report["runs"]} == {
        (transport, layout) for transport in ("ws", "sse") for layout in layouts}
    for run in report["runs"]:
        assert set(run) >= RUN_FIELDS, RUN_FIELDS - set(run)
        assert run["concurrency"] == 4 and run["failed"] == 0, run["errors"]
        assert run["served_tok_s"] > 0 and run["offline_tok_s"] > 0
        assert run["engine_process"] is (run["layout"] != "thread")  # the server's own report of its engine
        assert run["server_cpu_us_per_token"] >= 0  # /proc counts in 10 ms ticks: a run this small may read 0
    assert path.with_suffix(".md").exists()


def test_json_flag_writes_the_report_to_a_file_or_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = {"completed": 3, "ttft_s": {"p50": 0.25, "p99": None}, "errors": []}
    write_json(report, str(tmp_path / "report.json"))
    assert json.loads((tmp_path / "report.json").read_text()) == report
    write_json(report, "-")
    assert json.loads(capsys.readouterr().out) == report
    write_json(report, None)
    assert capsys.readouterr().out == "" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
