"""`streamd bench multiturn`, light form: a tiny random model and tiny sizes; the report's shape and its
invariants (identical greedy replies, fewer recomputed tokens with the disk tier, the system prompt found
after a restart), never its speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from streamd.bench.multiturn import Sizes, markdown, measure
from streamd.bench.report import report_header
from streamd.llm import LLM
from tests.helpers import register_engine, tiny_config

SIZES = Sizes(conversations=3, turns=2, system_tokens=40, turn_tokens=10, reply_tokens=3, block_size=8, vocab=300)


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
    assert report["greedy_outputs_identical"] is True
    assert disk["recomputed_prompt_tokens"] < plain["recomputed_prompt_tokens"]
    assert 0 < report["recomputed_tokens_reduction"] <= 1
    assert disk["tier"]["hit_blocks"] > 0 and disk["tier"]["bytes_written"] > 0
    restart = report["restart"]
    assert restart["cached_tokens"] >= restart["system_prompt_full_block_tokens"] == 40
    assert restart["system_prompt_restored"] is True
    assert restart["ttft_vs_warm"] == restart["ttft_s"] / restart["warm_ttft_s"]
    assert report["follow_up_ttft_speedup"] == plain["follow_up_ttft_p50_s"] / disk["follow_up_ttft_p50_s"]
    assert restart["ttft_s"] > 0 and restart["warm_ttft_s"] > 0
    assert report["follow_up_ttft_speedup"] > 0 and report["max_restore_vs_median_step"] >= 0
    text = markdown(report)
    assert "follow-up TTFT" in text and "restart: cached_tokens" in text
