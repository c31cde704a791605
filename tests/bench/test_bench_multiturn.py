"""`streamd bench multiturn`, light form: a tiny random model and tiny sizes; the report's shape and its
invariants (identical greedy replies, fewer recomputed tokens with the disk tier, the disk tier missing no
whole block that had been computed before, the token accounting adding up, the system prompt found after
every restart), never its speed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from streamd.bench.multiturn import Run, SeenPrefixes, Sizes, add_arguments, cacheable, markdown, measure, record, run
from streamd.bench.report import report_header
from streamd.llm import LLM
from tests.helpers import register_engine, tiny_config

SIZES = Sizes(
    conversations=3, turns=2, system_tokens=40, turn_tokens=10, reply_tokens=3, block_size=8, vocab=300, restarts=2
)


def make_llm(overrides: dict[str, Any]) -> LLM:
    llm = LLM(tiny_config(), device="cpu", dtype="float32", seed=5, num_swap_blocks=0, watermark=0.0, **overrides)
    register_engine(llm.engine)
    return llm


def test_light_multiturn_report(tmp_path: Path) -> None:
    report = report_header("cpu") | measure(make_llm, SIZES, tmp_path)
    plain, disk = report["device_only"], report["disk_tier"]
    assert report["sizes"]["num_kv_blocks"] == SIZES.num_kv_blocks()
    assert plain["requests"] == disk["requests"] == SIZES.conversations * SIZES.turns
    assert plain["prompt_tokens"] == disk["prompt_tokens"]
    assert plain["never_computed_tokens"] == disk["never_computed_tokens"]  # the workload's, not the cache's
    for r in (plain, disk):
        assert r["prefilled_prompt_tokens"] == r["never_computed_tokens"] + r["recomputed_prompt_tokens"]
        assert r["recomputed_prompt_tokens"] == r["recomputed_in_partial_blocks"] + r["missed_cacheable_tokens"]
    assert report["greedy_outputs_identical"] is True
    assert report["greedy_outputs_identical_to_unevicted"] is True
    unevicted = report["unevicted_device"]
    assert unevicted["missed_cacheable_tokens"] == 0 and unevicted["requests"] == plain["requests"]
    assert unevicted["prefilled_prompt_tokens"] == disk["prefilled_prompt_tokens"]  # the tier missed nothing
    assert disk["missed_cacheable_tokens"] == 0 < plain["missed_cacheable_tokens"]
    assert disk["dropped_spills"] == 0
    assert disk["recomputed_prompt_tokens"] < plain["recomputed_prompt_tokens"]
    assert 0 < report["recomputed_tokens_reduction"] <= 1 and 0 < report["prefilled_tokens_reduction"] <= 1
    assert disk["tier"]["hit_blocks"] > 0 and disk["tier"]["bytes_written"] > 0
    assert 0 < disk["steps_with_tier_work"] <= disk["steps"] and disk["max_tier_s_in_a_step"] > 0
    assert disk["max_tier_step_stretch"] > 1 and report["max_tier_vs_median_step"] > 0
    restart = report["restart"]
    assert len(restart["rounds"]) == SIZES.restarts == len(restart["ttft_vs_warm"])
    assert restart["system_prompt_full_block_tokens"] == 40 and restart["system_prompt_restored"] is True
    assert restart["rounds_reading_lost"] == []
    for r, ratio in zip(restart["rounds"], restart["ttft_vs_warm"], strict=True):
        assert r["cached_tokens"] >= 40 and r["tier_s"] > 0  # read back from disk
        assert 0 < r["read_s_per_block"] < r["recompute_s_per_block"]  # (why it read)
        assert ratio == r["ttft_s"] / r["warm_ttft_s"] and r["first_request_ttft_s"] > 0
    assert restart["max_ttft_vs_warm"] == max(restart["ttft_vs_warm"])
    assert sum(r["written_at_close"] for r in restart["rounds"]) > 0
    assert report["follow_up_ttft_speedup"] == plain["follow_up_ttft_p50_s"] / disk["follow_up_ttft_p50_s"]
    restores = report["restores"]  # (no host tier on the CPU: nothing swapped in; the link is a host copy)
    assert restores["bytes"] == 0 and restores["link_bytes_per_s"] > 0
    text = markdown(report)
    assert "follow-up TTFT" in text and "recomputed prompt tokens" in text and "| 2 |" in text
    assert "of the pinned link measured in this run" in text
    assert "lost to recomputing" not in text
    # A round whose restarted tier found reading slower than recomputing (the H200's): the report says so.
    restart["rounds"][1] |= {"cached_tokens": 0, "read_s_per_block": 9e-4, "recompute_s_per_block": 7e-4}
    restart |= {"rounds_reading_lost": [2], "system_prompt_restored": False}
    assert "restored every time: False (reading lost to recomputing in round 2: 0.90 vs 0.70 ms a block)" in (
        markdown(report)
    )


def test_seen_prefixes_count_what_was_computed_before() -> None:
    """The last reply token is never fed through the model; other conversations share only the system prompt;
    a perfect block cache serves whole blocks of the seen prefix, never the prompt's last token."""
    run = Run(block_size=4)
    system = [1, 2, 3, 4, 5, 6]
    record(run, system + [7, 8], [9, 10, 11], 0, 1.0, 0)
    record(run, system + [70, 80], [90], 0, 1.0, 4)
    record(run, system + [7, 8, 9, 10, 11, 12], [13], 1, 1.0, 8)
    assert run.seen_tokens == [0, 6, 10]  # (9, 10 fed; 11 sampled last, never computed)
    assert run.tokens() == {
        "prompt_tokens": 8 + 8 + 12,
        "prefilled_prompt_tokens": 28 - 12,
        "never_computed_tokens": 8 + 2 + 2,
        "recomputed_prompt_tokens": 6 - 4 + 10 - 8,
        "recomputed_in_partial_blocks": 2 + 2,
        "missed_cacheable_tokens": 0,
    }
    assert cacheable(10, 12, 4) == 8 and cacheable(12, 12, 4) == 8 and cacheable(3, 12, 4) == 0
    seen = SeenPrefixes()
    seen.add([5, 6, 7])
    assert seen.seen_length([5, 6, 8]) == 2 and seen.seen_length([6, 5]) == 0 and seen.seen_length([5, 6, 7, 1]) == 3


def test_a_random_shape_from_the_command_line(tmp_path: Path) -> None:
    """`--shape`: random weights of a named shape (the CPU's tiny one here; llama3.2-3b on a GPU), seeded, so
    every engine the bench opens has the same weights (device-only and tiered replies are identical)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    sizes = ["--conversations", "2", "--turns", "2", "--system-tokens", "40", "--turn-tokens", "10"]
    args = parser.parse_args(["--shape", "llama-tiny", *sizes, "--reply-tokens", "3", "--restarts", "1",
                              "--out", str(tmp_path)])
    assert run(args) == 0
    (written,) = tmp_path.glob("multiturn-*.json")
    report = json.loads(written.read_text())
    assert report["model"] == "llama-tiny" and report["greedy_outputs_identical"] is True
    assert report["restart"]["system_prompt_restored"] is True  # 2 blocks of 16 tokens
