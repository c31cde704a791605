"""`streamd bench replicas` end to end at a tiny size on the CPU: the cluster's replicas and vllm-router
started for each count, client processes through the router (and `--scale-load`), the report's counts and
totals. It tests the benchmark, not speed: two replicas share these two cores."""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from streamd.cli.cluster import router_command
from tests.helpers import sizes

pytestmark = pytest.mark.skipif(
    shutil.which("vllm-router") is None and not Path(sys.executable).with_name("vllm-router").exists(),
    reason="vllm-router is not installed",
)


def _free_base() -> int:
    """A base port whose offsets the bench uses (router +1, its metrics +2, replicas +10, +11) are all free."""
    while True:
        base = random.randrange(20000, 60000)
        try:
            for offset in (0, 1, 2, 10, 11):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base


@pytest.mark.parametrize("counts", sizes("1", "1,2"))  # one replica; full (slow): one, then two
def test_replicas_bench_loads_each_count_through_the_router(tmp_path: Path, counts: str) -> None:
    assert Path(router_command(1, 2, [3], "round_robin")[0]).exists()
    command = [sys.executable, "-m", "streamd.cli.main", "bench", "replicas", "--replicas", counts, "--scale-load",
               "--concurrency", "2", "--requests-per-stream", "1", "--max-tokens", "4", "--prompt-words", "6",
               "--clients", "1", "--first-port", str(_free_base()), "--out", str(tmp_path), "--",
               "--set", "cache.num_kv_blocks=256"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("replicas-scaled-*.json")
    report = json.loads(path.read_text())
    assert report["device"] == "cpu" and report["settings"]["scale_load"] is True
    assert [(r["replicas"], r["streams"]) for r in report["runs"]] == [(n, 2 * n) for n in map(int, counts.split(","))]
    for run in report["runs"]:
        assert run["failed"] == 0
        assert run["output_tokens"] == run["streams"] * 4  # ignore_eos: every request its max_tokens
        assert run["output_tok_s"] > 0
    assert report["runs"][0]["vs_first"] == 1.0
    assert path.with_suffix(".md").read_text().count("\n| ") == 1 + len(report["runs"])  # header, a row per count
