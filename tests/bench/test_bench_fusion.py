"""benchmarks/fusion.py in its CPU dry run: every mode builds, steps and generates; every fused kernel is
timed against its unfused sequence and agrees with it; the report is written (the device run is the same code)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import sizes

REPO = Path(__file__).resolve().parents[2]


# Light: the unfused model and the Triton kernels; full (slow): their torch reference too.
@pytest.mark.parametrize("modes", sizes(["off", "triton"], ["off", "reference", "triton"]))
def test_fusion_benchmark_dry_run(tmp_path: Path, modes: list[str]) -> None:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "fusion.py"), "--dry-run", "--modes",
                           ",".join(modes), "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    [report_file] = tmp_path.glob("fusion-dry-*-cpu.json")
    report = json.loads(report_file.read_text())
    assert report_file.with_suffix(".md").read_text().startswith("# Fused decoder layers, dry, cpu")
    macro = [r for r in report["rows"] if r["kind"] == "macro"]
    assert [r["mode"] for r in macro] == modes
    for row in macro:
        assert row["graph"]["step_s"] > 0 and row["engine"]["running"] == report["setup"]["batch"]
        # float32, fixed seeds: the fused paths generate the unfused model's greedy tokens
        assert row["agreement_with_off"] == 1.0, row["mode"]
    micro = [r for r in report["rows"] if r["kind"] == "micro"]
    assert sorted({r["kernel"] for r in micro}) == ["add+rmsnorm", "rotary+store_kv", "silu_and_mul"]
    assert len(micro) == 3 and all(r["max_abs_diff_vs_torch"] < 1e-4 for r in micro)
    assert all(set(r["t_s"]) == {"triton", "torch"} for r in micro)
