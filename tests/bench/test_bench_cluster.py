"""`streamd bench cluster`: the cost model reproduces the measured GPU runs it was fitted to, the router
policies route as documented, and a small simulated cluster behaves (prefix-aware routing hits the cache
more than round-robin, every turn completes, no block leaks)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from streamd.bench import cluster
from streamd.bench.cluster_sim import (
    ConversationConfig,
    EngineShape,
    PrefixAware,
    Replica,
    RoundRobin,
    RunConfig,
    StepCost,
    make_conversations,
    simulate,
)

ROOT = Path(__file__).resolve().parents[2]
COST = StepCost(base_s=2.5e-3, per_token_s=4.7e-6, per_context_token_s=7.6e-9)
SHAPE = EngineShape(num_blocks=4096)


def test_calibration_reproduces_the_measured_runs() -> None:
    cost, calibration = cluster.calibrate(ROOT / "benchmarks" / "results")
    assert cost.base_s > 0 and cost.per_token_s > 0 and cost.per_context_token_s > 0
    for run in calibration["runs"]:
        assert run["model_s"] == pytest.approx(run["measured_s"], rel=0.05), run


def test_prefix_aware_router_follows_the_prefix_and_balances_otherwise() -> None:
    replicas = [Replica(SHAPE) for _ in range(3)]
    router = PrefixAware(replicas, block_size=16, capacity_blocks=1000)
    first = list(range(100))
    where = router.route(first)
    replicas[where].outstanding += 1
    assert router.route(first + [7, 8, 9]) == where  # the same conversation, one turn later
    other = router.route(list(range(10_000, 10_100)))  # nothing cached anywhere: the least loaded
    assert other != where
    rr = RoundRobin(replicas, 16)
    assert [rr.route(first) for _ in range(4)] == [0, 1, 2, 0]


def test_small_cluster_prefix_aware_beats_round_robin() -> None:
    conversations = make_conversations(ConversationConfig(conversations=200, seed=1))
    run = RunConfig(users_per_replica=8, duration_s=10.0, warmup_s=2.0)
    results = {policy: simulate(conversations, 4, policy, SHAPE, COST, run) for policy in cluster.POLICIES}
    rr, pa = results["round_robin"], results["prefix_aware"]
    for result in (rr, pa):
        assert result.requests > 0 and result.output_tok_s > 0 and result.blocks_in_use_at_end == 0
    assert pa.prefix_hit_rate > rr.prefix_hit_rate + 0.1
    assert pa.prefill_tokens < rr.prefill_tokens
    one = [simulate(conversations, 1, policy, SHAPE, COST, run) for policy in cluster.POLICIES]
    assert one[0] == dataclasses.replace(one[1], policy=one[0].policy)  # one replica: routing is moot


def test_cli_writes_the_report(tmp_path: Path) -> None:
    args = ["--replicas", "1,2", "--users-per-replica", "4", "--duration-s", "8", "--warmup-s", "1",
            "--out-dir", str(tmp_path)]
    assert cluster.main(args) == 0
    [json_file] = tmp_path.glob("cluster-*.json")
    report = json.loads(json_file.read_text())
    assert [(r["replicas"], r["policy"]) for r in report["results"]] == [
        (1, "round_robin"), (1, "prefix_aware"), (2, "round_robin"), (2, "prefix_aware")]
    assert "| 2 | prefix_aware |" in json_file.with_suffix(".md").read_text()
