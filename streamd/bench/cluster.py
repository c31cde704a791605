"""`streamd bench cluster`: R replicas behind a router, round-robin against prefix-aware, simulated on the CPU.

Each replica is streamd's real Scheduler and BlockManager (prefix caching on); the forward pass is a cost
model calibrated from the committed H200 results for the `llama3.2-1b` shape (`benchmarks/results/`): the
decode-attention kernel rows give the cost per context token, and replaying the three measured offline runs
(random 256 x [100, 1024]; shared 500-token prefix with caching on and off) through the same scheduler gives
the step counts and token totals from which the fixed cost per step and the cost per batched token are
fitted (least squares; the residuals are reported). The workload is ShareGPT-like multi-turn chat opening
with shared system prompts (`cluster_sim.py`); the offered load per replica is the same for every R.
Reports prefix-hit rate, TTFT and throughput for each R and policy; writes
`cluster-<date>-cpu-simulation.json` and `.md` (`report.save_report`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

from streamd.bench.cluster_sim import (
    ConversationConfig,
    EngineShape,
    PrefixAware,
    RoundRobin,
    RunConfig,
    StepCost,
    make_conversations,
    replay_offline,
    simulate,
)
from streamd.bench.report import add_out_argument, git_commit, save_report

CALIBRATION_SHAPE = "llama3.2-1b"
THROUGHPUT_FILE = "throughput-2026-11-22-h200.json"
KERNELS_FILE = "kernels-2026-11-22-h200.json"
POLICIES = (RoundRobin.name, PrefixAware.name)
_CONVERSATIONS_PER_USER = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", default="1,2,4,8,16,64", help="comma-separated replica counts")
    parser.add_argument(
        "--users-per-replica", type=int, default=150, help="concurrent chat users per replica (closed loop)"
    )
    parser.add_argument("--duration-s", type=float, default=15.0, help="simulated seconds of new turns")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="not measured: the start of the run")
    # 32768 blocks x 16 tokens = 524k tokens: 16 GiB of KV for the llama3.2-1b shape (32 KiB a token).
    parser.add_argument("--num-blocks", type=int, default=32768, help="KV blocks per replica")
    parser.add_argument("--results-dir", default="benchmarks/results", help="where the GPU results lie")
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser)
    parser.add_argument("--no-write", action="store_true", help="print only")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamd bench cluster", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    replica_counts = [int(r) for r in args.replicas.split(",") if r.strip()]
    if not replica_counts or min(replica_counts) < 1:
        print(f"--replicas needs positive counts, got {args.replicas!r}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    cost, calibration = calibrate(Path(args.results_dir))
    if not 0 <= args.warmup_s < args.duration_s:
        print("--warmup-s must be in [0, --duration-s)", file=sys.stderr)
        return 2
    shape = EngineShape(num_blocks=args.num_blocks)
    run_config = RunConfig(args.users_per_replica, args.duration_s, args.warmup_s)
    rows = []
    for r in replica_counts:
        # More conversations than the users can finish in the run (a user ends one every ~15 s).
        workload = ConversationConfig(
            conversations=args.users_per_replica * r * _CONVERSATIONS_PER_USER, seed=args.seed
        )
        conversations = make_conversations(workload)
        for policy in POLICIES:
            result = simulate(conversations, r, policy, shape, cost, run_config)
            rows.append(dataclasses.asdict(result))
            print(_row(rows[-1]), flush=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "git_commit": git_commit(),
        "device": "cpu-simulation",
        "cost_model": {**dataclasses.asdict(cost), "calibration": calibration},
        "engine": dataclasses.asdict(shape),
        "workload": dataclasses.asdict(ConversationConfig(0, seed=args.seed)),
        "run": dataclasses.asdict(run_config),
        "results": rows,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    if not args.no_write:
        stem = save_report(report, args.out, "cluster", render_markdown(report))
        print(f"wrote {stem}.json and .md")
    return 0


def calibrate(results_dir: Path) -> tuple[StepCost, dict[str, object]]:
    """The step cost of the `llama3.2-1b` shape on the H200, from the committed results (see module doc)."""
    from streamd.bench.throughput import SHAPES, random_workload, shared_prefix_workload

    throughput = _load(results_dir / THROUGHPUT_FILE)
    kernels = _load(results_dir / KERNELS_FILE)
    layers = SHAPES[CALIBRATION_SHAPE]["num_hidden_layers"]
    rows = [
        r for r in kernels["rows"] if r["kind"] == "decode" and r["model"] == CALIBRATION_SHAPE and r["batch"] == 256
    ]
    slope, _ = _line([r["batch"] * r["context"] for r in rows], [r["t_paged_s"] for r in rows])
    per_context = slope * layers
    vocab = SHAPES[CALIBRATION_SHAPE]["vocab_size"]
    run = next(r for r in throughput["runs"] if r["model_shape"] == CALIBRATION_SHAPE)
    shared = shared_prefix_workload(vocab)
    prefix = throughput["prefix_cache"]  # one run (older reports) or one per system-prompt length
    if isinstance(prefix, list):
        prefix = next(p for p in prefix if p["workload"] == shared.name)
    random_work = random_workload(vocab)
    measured = [  # (name, prompts, output lengths, prefix caching, measured seconds)
        ("random-256", random_work.prompts, random_work.output_lens, True, run["streamd"]["seconds"]),
        ("shared-prefix on", shared.prompts, shared.output_lens, True, shared.output_tokens / prefix["tok_s_on"]),
        ("shared-prefix off", shared.prompts, shared.output_lens, False, shared.output_tokens / prefix["tok_s_off"]),
    ]
    totals = [
        replay_offline(p, o, EngineShape(num_blocks=1 << 17, enable_prefix_caching=c)) for _, p, o, c, _ in measured
    ]
    # seconds - per_context * context = base * steps + per_token * tokens, least squares over the runs
    base, per_token = _fit2(
        [(t.steps, t.tokens, s - per_context * t.context_tokens) for t, (*_, s) in zip(totals, measured)]
    )
    cost = StepCost(base, per_token, per_context)
    checks = [
        {
            "run": name,
            "measured_s": round(s, 3),
            "steps": t.steps,
            "tokens": t.tokens,
            "context_tokens": t.context_tokens,
            "model_s": round(base * t.steps + per_token * t.tokens + per_context * t.context_tokens, 3),
        }
        for t, (name, *_, s) in zip(totals, measured)
    ]
    return cost, {"shape": CALIBRATION_SHAPE, "sources": [THROUGHPUT_FILE, KERNELS_FILE], "runs": checks}


def _load(path: Path) -> dict:
    if not path.is_file():
        raise SystemExit(f"calibration needs {path} (the committed GPU results; see --results-dir)")
    return json.loads(path.read_text())


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def _fit2(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares (a, b) of y = a * u + b * v through the origin."""
    suu = sum(u * u for u, _, _ in rows)
    svv = sum(v * v for _, v, _ in rows)
    suv = sum(u * v for u, v, _ in rows)
    suy = sum(u * y for u, _, y in rows)
    svy = sum(v * y for _, v, y in rows)
    det = suu * svv - suv * suv
    return (suy * svv - svy * suv) / det, (svy * suu - suy * suv) / det


def _row(r: dict) -> str:
    return (
        f"| {r['replicas']} | {r['policy']} | {r['requests']} | {r['prefix_hit_rate']:.1%} | "
        f"{r['mean_ttft_s'] * 1e3:.1f} | {r['p99_ttft_s'] * 1e3:.1f} | {r['output_tok_s']:.0f} | "
        f"{r['output_tok_s'] / r['replicas']:.0f} | {r['busy_share']:.0%} | {r['prefill_tokens'] / 1e6:.2f} | "
        f"{r['min_replica_requests']}-{r['max_replica_requests']} |"
    )


def render_markdown(report: dict) -> str:
    cost, wl, eng, run = report["cost_model"], report["workload"], report["engine"], report["run"]
    lines = [
        f"# Cluster simulation ({report['date']}, commit {report['git_commit']})",
        "",
        "CPU simulation (`streamd bench cluster`): every replica is streamd's real Scheduler and "
        "BlockManager; the forward pass costs "
        f"{cost['base_s'] * 1e3:.2f} ms + {cost['per_token_s'] * 1e6:.2f} us per batched token + "
        f"{cost['per_context_token_s'] * 1e9:.2f} ns per context token attended, calibrated for the "
        f"{cost['calibration']['shape']} shape on an H200 from "
        + ", ".join(f"`{s}`" for s in cost["calibration"]["sources"])
        + ".",
        "",
        "| calibration run | measured s | model s | steps | batched tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for c in cost["calibration"]["runs"]:
        lines.append(f"| {c['run']} | {c['measured_s']} | {c['model_s']} | {c['steps']} | {c['tokens']} |")
    lines += [
        "",
        f"Workload: {run['users_per_replica']} chat users per replica (closed loop), each holding one "
        f"multi-turn conversation at a time for {run['duration_s']:.0f} simulated seconds (measured after "
        f"{run['warmup_s']:.0f} s); {wl['num_system_prompts']} shared system "
        f"prompts of {wl['system_prompt_len'][0]}-{wl['system_prompt_len'][1]} tokens (Zipf "
        f"{wl['zipf_s']}), 1 + floor(Exp(mean {wl['mean_turns'] - 1:g})) turns (at most {wl['max_turns']}), "
        f"ShareGPT turn lengths, think time "
        f"{wl['think_time_s']} s mean; each turn resends the whole conversation. Replica: "
        f"{eng['num_blocks']} blocks of {eng['block_size']}, max_num_seqs {eng['max_num_seqs']}, "
        f"max_num_batched_tokens {eng['max_num_batched_tokens']}.",
        "",
        "| replicas | policy | requests | prefix-hit rate | mean TTFT ms | p99 TTFT ms | output tok/s "
        "| tok/s per replica | replica busy | prompt tokens computed (M) | requests per replica (min-max) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines += [_row(r) for r in report["results"]]
    lines += ["", 'Limits: see `benchmarks/NOTES.md` (section "Cluster simulation").', ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
