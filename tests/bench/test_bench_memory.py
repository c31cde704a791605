"""The memory benchmark: workloads, the Orca baselines' allocator, and a quick end-to-end run."""

from __future__ import annotations

import argparse
import json

import pytest

import streamd.bench
from streamd.bench import memory
from streamd.bench.simulate import FirstFit, reservation
from streamd.bench.workloads import MAX_PROMPT_LEN, MAX_SEQ_LEN, WORKLOADS, RequestStream


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
def test_workload_means_match_the_paper(name):
    workload, stream = WORKLOADS[name], RequestStream(WORKLOADS[name], seed=0)
    pairs = [stream[i] for i in range(8192)]
    prompts, outputs = zip(*pairs)
    assert sum(prompts) / len(prompts) == pytest.approx(workload.input_mean, rel=0.05)
    assert sum(outputs) / len(outputs) == pytest.approx(workload.output_mean, rel=0.05)
    assert all(1 <= p <= MAX_PROMPT_LEN and o >= 1 and p + o <= MAX_SEQ_LEN for p, o in pairs)
    assert RequestStream(workload, seed=0)[5000] == pairs[5000]  # seeded: the same in every system
    other = RequestStream(workload, seed=1)
    assert [other[i] for i in range(8)] != pairs[:8]


def test_orca_reservations():
    assert reservation("max", 10, 25) == MAX_SEQ_LEN
    assert reservation("pow2", 10, 25) == 10 + 32
    assert reservation("pow2", 10, 32) == 10 + 32
    assert reservation("oracle", 10, 25) == 35


def test_first_fit_allocates_contiguously_and_coalesces():
    pool = FirstFit(100)
    a, b, c = pool.alloc(30), pool.alloc(30), pool.alloc(30)
    assert (a, b, c) == (0, 30, 60) and pool.alloc(20) is None  # 10 left
    pool.free(a, 30)
    pool.free(c, 30)
    assert pool.alloc(50) is None  # 30 + 40 free, but not contiguous: external fragmentation
    pool.free(b, 30)
    assert pool.alloc(100) == 0  # all three extents merged back into one


def test_quick_run_writes_report_and_meets_targets(tmp_path, capsys):
    assert memory.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr()
    assert "Orca (Max)" in printed.out and "[bench memory]" in printed.err  # table and progress
    [json_file] = tmp_path.glob("memory-*.json")
    [md_file] = tmp_path.glob("memory-*.md")
    report = json.loads(json_file.read_text())
    assert md_file.read_text() == memory.render_markdown(report)
    assert set(report["workloads"]) == set(WORKLOADS)
    for result in report["workloads"].values():
        systems = result["systems"]
        assert set(systems) == set(memory.SYSTEMS)
        for r in systems.values():
            assert 0 < r["token_state_share"] <= 1 and r["batched_requests"] > 0
        # Paging beats every contiguous reservation on both measures.
        for orca in ("orca-max", "orca-pow2", "orca-oracle"):
            assert systems["streamd"]["token_state_share"] > systems[orca]["token_state_share"]
            assert systems["streamd"]["batched_requests"] > systems[orca]["batched_requests"]
        assert systems["orca-max"]["batched_requests"] == pytest.approx(7.0)  # 14,400 slots / 2,048
    targets = report["targets"]
    assert targets["met"] and targets["token_state_share"] >= 0.963 and targets["batch_ratio_vs_orca_max"] >= 3


def test_bench_subcommand_dispatch(tmp_path):
    parser = argparse.ArgumentParser()
    streamd.bench.add_arguments(parser)
    args = parser.parse_args(["memory", "--quick", "--workloads", "alpaca", "--no-write",
                              "--out-dir", str(tmp_path)])
    assert streamd.bench.run(args) == 0  # no target workload in the run: nothing to miss
    assert list(tmp_path.iterdir()) == []
    assert memory.main(["--workloads", "nope", "--no-write"]) == 2


def test_sharing_saves_blocks_and_beams_share_more_than_samples():
    from streamd.bench.sharing import simulate_sharing

    stream = RequestStream(WORKLOADS["alpaca"], seed=0)
    runs = {mode: simulate_sharing(stream, mode, 4, steps=150, warmup=15, num_blocks=300, block_size=16,
                                   max_num_seqs=256, max_num_batched_tokens=2048, seed=0, progress=lambda f: None)
            for mode in ("parallel", "beam")}
    assert 0 < runs["parallel"]["saving"] < runs["beam"]["saving"] < 1, runs
    assert all(r["blocks_used"] <= 300 and r["blocks_used"] < r["blocks_unshared"] for r in runs.values())


def test_window_run_reports_the_hybrid_layouts_bytes_per_token(tmp_path, capsys):
    """`--window --quick`: the real scheduler and block managers over the real shapes (no engine run); a long
    request holds what the window arithmetic says, within the blocks rounding adds."""
    assert memory.main(["--window", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads(next(tmp_path.glob("memory-window-*.json")).read_text())
    rows = {(row["model"], row["context"]): row for row in report["shapes"]}
    assert report["engine"] is None
    for row in rows.values():
        assert row["ideal_ratio"] - 1e-3 <= row["ratio"] <= row["ideal_ratio"] + 0.02, row
    assert rows[("gemma-3-27b", 32768)]["ratio"] < 0.2, "a long Gemma 3 request: about a sixth"
    assert rows[("gemma-2-9b", 1024)]["ratio"] == 1.0, "shorter than the window: nothing to save"
    assert "hybrid / plain" in capsys.readouterr().out
