"""`streamd bench fairness`, light form: every workload runs to the end on the default model at tiny sizes,
and the report has every measure and target (speed is not asserted: the committed results hold it)."""

from __future__ import annotations

import math

import pytest

from streamd.bench import fairness
from streamd.bench.fairness import Run, Sizes
from tests.helpers import sizes

# `make test`'s form: the fewest requests that still make every workload (flood beside chats, backlog, tiers).
TINY = Sizes(seats=2, flood=4, long_prompt=16, long_output=4, chats=2, chat_every=2, backlog=4, tier_requests=16,
             window_s=0.05)


@pytest.mark.parametrize("size", sizes(TINY, fairness.LIGHT))
def test_light_form_reports_every_measure(smol_llm, size: Sizes) -> None:
    engine = smol_llm.engine
    before = engine.scheduler.fair
    try:
        result = fairness.measure(engine, size)
    finally:
        engine.scheduler.fair = before
    flood = result["flood_and_chat"]
    assert set(flood["chat_p99_ttft_s"]) == {"solo", "fair", "fcfs"}
    assert all(v > 0 for v in flood["chat_p99_ttft_s"].values())
    assert flood["fair_over_fcfs"] == flood["chat_p99_ttft_s"]["fair"] / flood["chat_p99_ttft_s"]["fcfs"]
    assert flood["throughput_fair_over_fcfs"] > 0 and flood["max_queue_s"] > 0
    assert result["tiers"]["p50_ttft_s"]["priority"] > 0
    for part in result.values():
        assert part["targets"] and all(isinstance(met, bool) for met in part["targets"].values())
    report = {"date": "d", "device": "cpu", "git_commit": "c", "models": {"default": {"sizes": {}, **result}}}
    text = fairness.markdown(report)
    assert "chat p99 fair / fcfs" in text and "default / priority p50" in text
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks() == engine.block_manager.num_blocks


def test_window_shares_count_whole_windows_while_both_are_served() -> None:
    run = Run(served=[(t / 10, tenant, weight) for t in range(100) for tenant, weight in (("A", 2.0), ("B", 1.0))])
    shares = fairness.window_shares(run, 1.0)
    assert len(shares) == 8  # 10 s of service, the first window and the partial last one left out
    assert all(math.isclose(s, 2 / 3) for s in shares)
    assert len(fairness.window_shares(run, 1.0, until=5.0)) == 4  # [1, 2) .. [4, 5): the refill stopped at 5 s
    assert fairness.window_shares(Run(), 1.0) == []
