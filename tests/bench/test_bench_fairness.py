"""`streamd bench fairness`, light form: every workload runs to the end on the default model at tiny sizes,
and the report has every measure and target (speed is not asserted: the committed results hold it)."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import pytest

from streamd.bench import fairness
from streamd.bench.fairness import Run, Sizes
from streamd.bench.report import BenchError
from streamd.engine.core.fairness import OUTPUT_WEIGHT, PROMPT_WEIGHT
from tests.helpers import sizes

# `make test`'s form: the fewest requests that still make every workload (flood beside chats, backlog, tiers).
TINY = Sizes(seats=2, flood=4, long_prompt=16, long_output=4, chats=2, chat_every=2, backlog=4, tier_requests=16,
             window_s=0.05)


@pytest.mark.parametrize("size", sizes(TINY, fairness.LIGHT))
def test_light_form_reports_every_measure(smol_llm, size: Sizes) -> None:
    engine = smol_llm.engine
    before = engine.scheduler.fair
    try:
        result = fairness.measure(engine, size, warmup_rounds=0)  # (the warm-up's order: tested below)
    finally:
        engine.scheduler.fair = before
    flood, back, tier = result["flood_and_chat"], result["backlog"], result["tiers"]
    p99 = flood["chat_p99_ttft_s"]
    assert set(p99) == {"solo", "fair", "fcfs"} and all(v > 0 for v in p99.values())
    for parts in flood["chat_ttft_parts"].values():  # a first token takes a step at least, queued or not
        assert 1 <= parts["steps_p50"] <= parts["steps_max"] and parts["step_ms"] > 0 and parts["queue_p99_s"] >= 0
    assert flood["fair_over_solo"] == p99["fair"] / p99["solo"]
    assert flood["fair_over_fcfs"] == p99["fair"] / p99["fcfs"]
    rates = flood["tokens_per_s"]
    assert flood["throughput_fair_over_fcfs"] == rates["fair"] / rates["fcfs"] and rates["fcfs"] > 0
    whole = flood["makespan_tokens_per_s"]
    assert flood["makespan_fair_over_fcfs"] == whole["fair"] / whole["fcfs"] and whole["fcfs"] > 0
    cpu = flood["tokens_per_cpu_s"]
    assert flood["cpu_throughput_fair_over_fcfs"] == cpu["fair"] / cpu["fcfs"] and cpu["fcfs"] > 0
    assert flood["max_queue_s"] >= max(p99["fair"], p99["fcfs"], *flood["flood_p50_ttft_s"].values())
    assert flood["targets"] == {
        "chat_p99_le_1.5x_solo": flood["fair_over_solo"] <= 1.5,
        "chat_p99_le_0.2x_fcfs": flood["fair_over_fcfs"] <= 0.2,
        "throughput_ge_0.95x_fcfs": flood["throughput_fair_over_fcfs"] >= 0.95,
    }
    shares = back["shares_A"]
    assert back["windows"] == len(shares) <= fairness.MEASURED_WINDOWS and all(0 <= s <= 1 for s in shares)
    assert back["targets"] == {"shares_50_pm_5": bool(shares) and all(abs(s - 0.5) <= 0.05 for s in shares)}
    assert tier["default_over_priority"] == tier["p50_ttft_s"]["default"] / tier["p50_ttft_s"]["priority"] > 0
    assert tier["targets"] == {"priority_p50_3x_lower": tier["default_over_priority"] >= 3}
    report = {"date": "d", "device": "cpu", "git_commit": "c", "models": {"default": {"sizes": {}, **result}}}
    text = fairness.markdown(report)
    assert "chat p99 fair / fcfs" in text and "default / priority p50" in text
    assert text.count("\n| ") == 1 + 13  # the header, then a row per measure
    assert flood["rounds"] == [["solo", "fair", "fcfs"]] and 0 < flood["prefill_step_share"]["fair"] <= 1
    assert not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks() == engine.block_manager.num_blocks


def test_window_shares_count_whole_windows_while_both_are_served() -> None:
    run = Run(served=[(t / 10, tenant, weight) for t in range(100) for tenant, weight in (("A", 2.0), ("B", 1.0))])
    shares = fairness.window_shares(run, 1.0)
    assert len(shares) == 8  # 10 s of service, the first window and the partial last one left out
    assert all(math.isclose(s, 2 / 3) for s in shares)
    assert len(fairness.window_shares(run, 1.0, until=5.0)) == 4  # [1, 2) .. [4, 5): the refill stopped at 5 s
    assert fairness.window_shares(Run(), 1.0) == []


def test_drive_counts_every_token_by_tenant_and_weight(smol_llm) -> None:
    """What the measures stand on: each request's first token timed, every prompt and output token counted
    once, and the weighted tokens (what the backlog's shares compare) credited to their tenant."""
    engine = smol_llm.engine
    before = engine.scheduler.fair
    arrivals = [fairness.Arrival(0, "a0", "A", 20, 3), fairness.Arrival(1, "b0", "B", 9, 2),
                fairness.Arrival(3, "a1", "A", 12, 4)]
    try:
        run = fairness.drive(engine, arrivals, True, lambda _: [])
    finally:
        engine.scheduler.fair = before
    assert set(run.timings) == {"a0", "b0", "a1"} and all(t.first_token is not None for t in run.timings.values())
    assert run.tokens == sum(a.prompt_len + a.max_tokens for a in arrivals) and run.seconds > 0
    weighted = {tenant: sum(w for _, t, w in run.served if t == tenant) for tenant in ("A", "B")}
    assert weighted == {
        tenant: sum(PROMPT_WEIGHT * a.prompt_len + OUTPUT_WEIGHT * a.max_tokens for a in arrivals if a.tenant == tenant)
        for tenant in ("A", "B")
    }
    assert [t for t, _, _ in run.served] == sorted(t for t, _, _ in run.served)


def test_device_flag_puts_the_model_there() -> None:
    """`--device cuda` (the GPU run) loads the model on that device in its default dtype; the CPU keeps float32."""
    import argparse

    parser = argparse.ArgumentParser()
    fairness.add_arguments(parser)
    assert parser.parse_args([]).device == "cpu"
    on_gpu = fairness.engine_overrides(TINY, parser.parse_args(["--device", "cuda"]).device)
    assert (on_gpu["model.device"], on_gpu["model.dtype"]) == ("cuda", "auto")
    on_cpu = fairness.engine_overrides(TINY, "cpu")
    assert (on_cpu["model.device"], on_cpu["model.dtype"]) == ("cpu", "float32")
    assert on_gpu["scheduler.max_num_seqs"] == TINY.seats


def test_set_puts_engine_settings_over_the_benchs_own(monkeypatch) -> None:
    """`--set KEY=VALUE` reaches the engine (the environment does not: a run says all it was run with)."""
    parser = argparse.ArgumentParser()
    fairness.add_arguments(parser)
    args = parser.parse_args(["--set", "scheduler.catch_up_chunk_tokens=32", "--set", "scheduler.max_num_seqs=3"])
    settings = dict(fairness.parse_assignment(item) for item in args.set)
    monkeypatch.setenv("STREAMD_SCHEDULER__CATCH_UP_CHUNK_TOKENS", "7")
    engine = fairness.build_engine("null", TINY, "cpu", settings)
    try:
        assert engine.scheduler.config.catch_up_chunk_tokens == 32
        assert engine.scheduler.max_num_seqs == 3  # over the bench's seats (TINY: 2)
    finally:
        engine.executor.shutdown()


def test_untimed_rounds_first_then_timed_rounds_in_alternating_order(monkeypatch) -> None:
    """`--warmup-rounds 1 --rounds 2`: solo, fair, fcfs untimed; then solo, fair, fcfs and fcfs, fair, solo,
    each timed run pooled under its policy (the null model: only the order is asserted)."""
    engine, calls = fairness.build_engine("null", TINY), []
    real = fairness.drive

    def recorded(engine, arrivals, fair, refill):
        calls.append("solo" if all(a.tenant == "B" for a in arrivals) else "fair" if fair else "fcfs")
        return real(engine, arrivals, fair, refill)

    monkeypatch.setattr(fairness, "drive", recorded)
    try:
        result = fairness.flood_and_chat(engine, replace(TINY, rounds=2), warmup_rounds=1)
    finally:
        engine.executor.shutdown()
    assert calls == ["solo", "fair", "fcfs", "solo", "fair", "fcfs", "fcfs", "fair", "solo"]
    assert result["rounds"] == [["solo", "fair", "fcfs"], ["fcfs", "fair", "solo"]]
    assert all(len(p99s) == 2 for p99s in result["chat_p99_ttft_s_by_round"].values())
    assert "schedule" not in vars(engine.scheduler)  # the step counter is gone after each run


def test_the_null_model_is_refused_off_the_cpu() -> None:
    parser = argparse.ArgumentParser()
    fairness.add_arguments(parser)
    args = parser.parse_args(["--models", "null", "--device", "cuda", "--no-write"])
    with pytest.raises(BenchError, match="null model has no weights"):
        fairness.run(args)
    with pytest.raises(BenchError, match="--rounds must be >= 1"):
        fairness.sizes_for("default", False, None, rounds=0)
