"""Many tenants on one engine: a flood beside a chat, two backlogged tenants, and service tiers.

`streamd bench fairness` drives the real LLMEngine in this process (`--models null`: the null model,
benchmark-only, see null_model.py; `default`: the default model on the CPU), each workload under
`scheduler.scheduling = "fair"` and `"fcfs"` on the same engine in one invocation (the scheduler's fair share
is rebuilt between runs; prefix caching is off so no run warms another). Arrivals are on the driver's ticks
(one engine step per tick while there is work), so every run sees the same arrival pattern; times are wall
seconds. The targets (issue 30) are checked beside the numbers:

- flood and chat: tenant A submits `flood` long requests at once, tenant B a short one every few ticks;
  B's p99 TTFT under fair <= 1.5x its solo run and <= 0.2x its TTFT under fcfs; throughput (all tokens over
  the run's wall time) fair >= 0.95x fcfs. First `--warmup-rounds` untimed rounds of the three runs (a fresh
  engine's first prefill shapes, Triton's compiles, on a GPU), then `--rounds` timed ones, pooled, in
  alternating order (solo, fair, fcfs; then fcfs, fair, solo; ...), so neither warm-up nor a drift in the
  machine's load falls on one policy. Per run the share of steps that carried a prompt chunk is reported:
  on CUDA only decode-only steps replay a decode graph, the others run eagerly (several times slower for a
  small model), which tells a policy's step mix from its order.
- backlog: A (long requests) and B (short) both keep a queue; each tenant's share of the weighted tokens
  (prompt 1, output 2: what the fair share equalizes) in every `--window-s` window is 50 +- 5%.
- tiers: one tenant saturates the engine, a quarter of its requests `service_tier: "priority"`; their p50
  TTFT is >= 3x lower than the default ones'.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from streamd.bench.report import BenchError, add_out_argument, markdown_table, report_header, save_report
from streamd.config import load_config, parse_assignment
from streamd.engine.core.fairness import OUTPUT_WEIGHT, PROMPT_WEIGHT, FairShare
from streamd.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the CLI imports this module to build its parser: no torch there)
    from streamd.engine.core.scheduler_output import SchedulerOutput
    from streamd.engine.llm_engine import LLMEngine


@dataclass(slots=True, frozen=True)
class Arrival:
    tick: int
    request_id: str
    tenant: str
    prompt_len: int
    max_tokens: int
    tier: str = "default"


@dataclass(slots=True)
class Timing:
    tenant: str
    tier: str
    arrived: float
    first_token: float | None = None
    queued: float = 0.0  # seconds from arrival to its first scheduling (the engine's `queue_time`)

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.arrived


@dataclass(slots=True)
class Run:
    """What one workload did: per request timings, per tenant weighted tokens over time, wall seconds."""

    timings: dict[str, Timing] = field(default_factory=dict)
    served: list[tuple[float, str, float]] = field(default_factory=list)  # (time, tenant, weighted tokens)
    tokens: int = 0
    seconds: float = 0.0
    step_ends: list[float] = field(default_factory=list)  # when each engine step returned
    prefill_steps: int = 0  # steps that scheduled a prompt chunk (on CUDA: eager, never a decode graph)
    # Tokens and seconds until the queue first ran empty with every request submitted: while every seat was
    # wanted (the rest is the last requests' tail, which the policies fill differently: not their rate).
    saturated_tokens: int = 0
    saturated_s: float = 0.0
    saturated_cpu_s: float = 0.0  # this process's CPU seconds in that time (other processes' slices left out)

    def ttfts(self, tenant: str | None = None, tier: str | None = None) -> list[float]:
        return sorted(t.ttft for t in self.timings.values() if tenant in (None, t.tenant) and tier in (None, t.tier))

    def steps_to_first_token(self, timing: Timing) -> int:
        """The engine steps that ran while `timing`'s request waited for its first token, the one that
        delivered it included (its time is taken before that step's end is)."""
        ends = self.step_ends
        return 1 + bisect.bisect_right(ends, timing.first_token or 0.0) - bisect.bisect_right(ends, timing.arrived)


@dataclass(slots=True, frozen=True)
class Sizes:
    """A workload's scale: `light` for the test, the full one for the committed results."""

    seats: int  # scheduler.max_num_seqs
    flood: int  # A's requests in the flood
    long_prompt: int
    long_output: int
    chats: int  # B's requests
    chat_every: int  # ticks between B's requests
    backlog: int  # each tenant's queued requests in the backlog run
    tier_requests: int
    window_s: float
    rounds: int = 1  # flood and chat: solo, fair and fcfs run this many times, in alternating order, pooled


MEASURED_WINDOWS = 3  # the backlog run's windows after the first (which fills the seats)
# Per model: the null model's steps cost milliseconds, the default model's on 2 CPU cores tens of them.
FULL = {
    "null": Sizes(
        seats=16,
        flood=96,
        long_prompt=256,
        long_output=96,
        chats=12,
        chat_every=8,
        backlog=160,
        tier_requests=160,
        window_s=0.5,
        rounds=3,
    ),
    "default": Sizes(
        seats=8,
        flood=24,
        long_prompt=96,
        long_output=32,
        chats=6,
        chat_every=6,
        backlog=16,
        tier_requests=48,
        window_s=10.0,
    ),
}
LIGHT = Sizes(
    seats=4, flood=8, long_prompt=32, long_output=6, chats=2, chat_every=3, backlog=4, tier_requests=8, window_s=0.05
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="null,default", help="comma-separated: null, default")
    parser.add_argument("--light", action="store_true", help="tiny sizes (the test's form)")
    parser.add_argument("--window-s", type=float, default=None, help="the backlog run's share window (seconds)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="flood and chat: timed rounds (order alternates; default per model)"
    )
    parser.add_argument(
        "--warmup-rounds", type=int, default=1, help="flood and chat: untimed rounds of the same runs first"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the default model runs: cpu, cuda (the null model has no weights)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting over the bench's own (e.g. scheduler.catch_up_chunk_tokens=32); repeatable",
    )
    add_out_argument(parser)
    parser.add_argument("--no-write", action="store_true", help="print only")


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {**report_header(args.device), "benchmark": "fairness", "models": {}}
    models = args.models.split(",")
    all_sizes = {name: sizes_for(name, args.light, args.window_s, args.rounds) for name in models}
    if "null" in models and args.device != "cpu":
        raise BenchError(
            "--models null runs on the CPU only: the null model has no weights and measures the scheduler alone "
            "(run it with --device cpu, and the default model with --models default --device cuda)"
        )
    settings = dict(parse_assignment(item) for item in args.set)
    report["settings"] = settings
    for name, sizes in all_sizes.items():
        engine = build_engine(name, sizes, args.device, settings)
        try:
            result = measure(engine, sizes, args.warmup_rounds)
            report["models"][name] = {"sizes": asdict(sizes), "warmup_rounds": args.warmup_rounds, **result}
        finally:
            engine.executor.shutdown()
    text = markdown(report)
    print(text)
    if not args.no_write:
        print(f"wrote {save_report(report, args.out, 'fairness', text)}.{{json,md}}")
    return 0


def sizes_for(model: str, light: bool, window_s: float | None, rounds: int | None = None) -> Sizes:
    if model not in FULL:
        raise ValueError(f"--models: unknown model {model!r} (null or default)")
    sizes = LIGHT if light else FULL[model]
    if rounds is not None:
        if rounds < 1:
            raise BenchError(f"--rounds must be >= 1, got {rounds}")
        sizes = replace(sizes, rounds=rounds)
    return sizes if window_s is None else replace(sizes, window_s=window_s)


def engine_overrides(sizes: Sizes, device: str) -> dict[str, Any]:
    """The engine's config for one model: `device` holds the weights (float32 on the CPU, the device's
    default dtype elsewhere)."""
    return {
        "model.device": device,
        "model.dtype": "float32" if device == "cpu" else "auto",
        "cache.enable_prefix_caching": False,
        "cache.num_kv_blocks": 4096,
        "cache.num_swap_blocks": 0,
        "scheduler.max_num_seqs": sizes.seats,
        "scheduler.max_num_batched_tokens": 1024,
    }


def build_engine(model: str, sizes: Sizes, device: str = "cpu", settings: dict[str, Any] | None = None) -> LLMEngine:
    """The engine of one model: the bench's settings (`engine_overrides`), then `settings` (`--set`) over them; the
    environment is not read (a run says all it was run with)."""
    config = load_config(overrides={**engine_overrides(sizes, device), **(settings or {})}, environ={})
    if model == "null":
        from streamd.bench.null_model import null_engine

        return null_engine(config)
    from streamd.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(config)


# ---- driving ------------------------------------------------------------------------------------------


def drive(engine: LLMEngine, arrivals: list[Arrival], fair: bool, refill: Callable[[int], list[Arrival]]) -> Run:
    """Runs `arrivals` (by tick; `refill(tick)` may add more) to the end under fair or fcfs order."""
    scheduler = engine.scheduler
    scheduler.fair = FairShare(fair, scheduler.config.tenant_weight_map())
    pending, out = sorted(arrivals, key=lambda a: a.tick), Run()
    scheduler.schedule = counting_prefills(scheduler.schedule, out)  # type: ignore[method-assign]
    try:
        return drive_ticks(engine, pending, refill, out)
    finally:
        del scheduler.schedule  # (the instance attribute: the class's method again)


def counting_prefills(schedule: Callable[[], SchedulerOutput], out: Run) -> Callable[[], SchedulerOutput]:
    """`schedule`, counting into `out` the steps that carry a prompt chunk."""

    def counted() -> SchedulerOutput:
        plan = schedule()
        out.prefill_steps += plan.num_prefill_tokens > 0
        return plan

    return counted


def drive_ticks(engine: LLMEngine, pending: list[Arrival], refill: Callable[[int], list[Arrival]], out: Run) -> Run:
    """`drive`'s loop: a tick submits what arrived and runs one step while there is work."""
    scheduler, tick = engine.scheduler, 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while True:
        pending.extend(refill(tick))
        if not pending and not engine.has_unfinished_requests():
            break
        while pending and pending[0].tick <= tick:
            submit(engine, pending.pop(0), out)
        tick += 1
        if engine.has_unfinished_requests():
            step(engine, out)
        if not out.saturated_s and not pending and not scheduler.waiting:
            out.saturated_tokens, out.saturated_s = out.tokens, time.perf_counter() - start
            out.saturated_cpu_s = time.process_time() - cpu_start
    out.seconds = time.perf_counter() - start
    return out


def submit(engine: LLMEngine, arrival: Arrival, out: Run) -> None:
    params = SamplingParams(
        max_tokens=arrival.max_tokens, ignore_eos=True, tenant=arrival.tenant, service_tier=arrival.tier
    )
    prompt = [100 + (zlib.crc32(arrival.request_id.encode()) + i) % 20000 for i in range(arrival.prompt_len)]
    engine.add_request(arrival.request_id, None, params, prompt_token_ids=prompt)
    out.timings[arrival.request_id] = Timing(arrival.tenant, arrival.tier, time.perf_counter())


def step(engine: LLMEngine, out: Run) -> None:
    weighted: dict[str, float] = {}  # this step's weighted tokens per tenant
    for delta in engine.step():
        timing = out.timings[delta.request_id]
        tokens = sum(len(c.token_ids) for c in delta.outputs)
        if delta.queue_time is not None:
            timing.queued = delta.queue_time
        if tokens and timing.first_token is None:
            timing.first_token = time.perf_counter()
            prompt = PROMPT_WEIGHT * delta.num_prompt_tokens
            weighted[timing.tenant] = weighted.get(timing.tenant, 0.0) + prompt
            out.tokens += delta.num_prompt_tokens
        weighted[timing.tenant] = weighted.get(timing.tenant, 0.0) + OUTPUT_WEIGHT * tokens
        out.tokens += tokens
    now = time.perf_counter()
    out.step_ends.append(now)
    out.served.extend((now, tenant, weight) for tenant, weight in weighted.items())


# ---- workloads ----------------------------------------------------------------------------------------


POLICY_ORDER = ("solo", "fair", "fcfs")


def round_order(index: int) -> tuple[str, ...]:
    """Round `index`'s run order: solo, fair, fcfs, then reversed, alternately (a linear drift in the
    machine's speed, or a warm-up the untimed rounds missed, then falls on each alike)."""
    return POLICY_ORDER if index % 2 == 0 else POLICY_ORDER[::-1]


def flood_and_chat(engine: LLMEngine, sizes: Sizes, warmup_rounds: int = 1) -> dict[str, Any]:
    chats = [Arrival(2 + i * sizes.chat_every, f"b{i}", "B", 24, 8) for i in range(sizes.chats)]
    flood = [Arrival(0, f"a{i}", "A", sizes.long_prompt, sizes.long_output) for i in range(sizes.flood)]
    work = {"solo": (chats, True), "fair": (flood + chats, True), "fcfs": (flood + chats, False)}
    for _ in range(warmup_rounds):  # untimed: a fresh engine's first steps of each run's shapes
        for name in POLICY_ORDER:
            drive(engine, *work[name], no_refill)
    runs: dict[str, list[Run]] = {name: [] for name in POLICY_ORDER}
    for index in range(sizes.rounds):
        for name in round_order(index):
            runs[name].append(drive(engine, *work[name], no_refill))
    p99 = {name: percentile(pooled_ttfts(rs, "B"), 99) for name, rs in runs.items()}
    loaded = {name: runs[name] for name in ("fair", "fcfs")}
    throughput = {name: saturated_rate(rs) for name, rs in loaded.items()}
    per_cpu_s = {name: saturated_rate(rs, cpu=True) for name, rs in loaded.items()}
    makespan = {name: sum(r.tokens for r in rs) / sum(r.seconds for r in rs) for name, rs in loaded.items()}
    result: dict[str, Any] = {
        "chat_p99_ttft_s": p99,
        "chat_ttft_parts": {name: ttft_parts(rs, "B") for name, rs in runs.items()},
        "flood_p50_ttft_s": {name: percentile(pooled_ttfts(rs, "A"), 50) for name, rs in loaded.items()},
        "tokens_per_s": throughput,
        "makespan_tokens_per_s": makespan,
        "tokens_per_cpu_s": per_cpu_s,
        "fair_over_solo": p99["fair"] / p99["solo"],
        "fair_over_fcfs": p99["fair"] / p99["fcfs"],
        "throughput_fair_over_fcfs": throughput["fair"] / throughput["fcfs"],
        "makespan_fair_over_fcfs": makespan["fair"] / makespan["fcfs"],
        "cpu_throughput_fair_over_fcfs": per_cpu_s["fair"] / per_cpu_s["fcfs"],
        "max_queue_s": pooled_ttfts(runs["fair"] + runs["fcfs"])[-1],
        "rounds": [list(round_order(i)) for i in range(sizes.rounds)],
        "chat_p99_ttft_s_by_round": {name: [percentile(r.ttfts("B"), 99) for r in rs] for name, rs in runs.items()},
        "prefill_step_share": {name: prefill_share(rs) for name, rs in runs.items()},
    }
    result["targets"] = {
        "chat_p99_le_1.5x_solo": result["fair_over_solo"] <= 1.5,
        "chat_p99_le_0.2x_fcfs": result["fair_over_fcfs"] <= 0.2,
        "throughput_ge_0.95x_fcfs": result["throughput_fair_over_fcfs"] >= 0.95,
    }
    return result


def no_refill(tick: int) -> list[Arrival]:
    return []


def prefill_share(runs: list[Run]) -> float:
    """The share of `runs`' steps that carried a prompt chunk."""
    return sum(r.prefill_steps for r in runs) / max(1, sum(len(r.step_ends) for r in runs))


def saturated_rate(runs: list[Run], cpu: bool = False) -> float:
    """Tokens per second (wall, or this process's CPU seconds) over `runs` while each had requests waiting."""
    return sum(r.saturated_tokens for r in runs) / sum(r.saturated_cpu_s if cpu else r.saturated_s for r in runs)


def pooled_ttfts(runs: list[Run], tenant: str | None = None) -> list[float]:
    return sorted(ttft for run in runs for ttft in run.ttfts(tenant))


def ttft_parts(runs: list[Run], tenant: str) -> dict[str, float]:
    """Where `tenant`'s TTFT went over `runs`: p99 queue wait (arrival to first scheduling), the median and
    largest number of steps to the first token, and the mean step duration over those waits (ms)."""
    waits = [(run, t) for run in runs for t in run.timings.values() if t.tenant == tenant]
    steps = sorted(run.steps_to_first_token(t) for run, t in waits)
    return {
        "queue_p99_s": percentile(sorted(t.queued for _, t in waits), 99),
        "steps_p50": percentile([float(n) for n in steps], 50),
        "steps_max": float(steps[-1]),
        "step_ms": 1e3 * sum(t.ttft for _, t in waits) / sum(steps),
    }


def backlog(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    """A (long requests) and B (short) each keep `backlog` requests queued, refilled every tick, for
    `MEASURED_WINDOWS` + 1 windows; then whatever is left is aborted (draining A's backlog measures nothing)."""
    counts = {"A": 0, "B": 0}
    shapes = {"A": (sizes.long_prompt, sizes.long_output), "B": (sizes.long_prompt // 4, sizes.long_output // 4)}
    until: list[float] = []  # when refilling stops (set at the first refill)

    def refill(tick: int) -> list[Arrival]:
        now = time.perf_counter()
        until.append(until[0] if until else now + (MEASURED_WINDOWS + 1) * sizes.window_s)
        if now > until[0]:
            for group in [*engine.scheduler.running, *engine.scheduler.waiting, *engine.scheduler.swapped]:
                engine.abort(group.request_id)
            return []
        waiting = dict.fromkeys(counts, 0)
        for group in engine.scheduler.waiting:
            waiting[group.sampling_params.tenant] += 1
        new = []
        for tenant, queued in waiting.items():
            for _ in range(queued, sizes.backlog):
                prompt, output = shapes[tenant]
                new.append(Arrival(tick, f"{tenant.lower()}{counts[tenant]}", tenant, prompt, output))
                counts[tenant] += 1
        return new

    out = drive(engine, [], True, refill)
    shares = window_shares(out, sizes.window_s, until[0])
    return {
        "window_s": sizes.window_s,
        "windows": len(shares),
        "shares_A": [round(share, 4) for share in shares],
        "share_A_min": min(shares, default=float("nan")),
        "share_A_max": max(shares, default=float("nan")),
        "targets": {"shares_50_pm_5": bool(shares) and all(abs(s - 0.5) <= 0.05 for s in shares)},
    }


def window_shares(out: Run, window_s: float, until: float = float("inf")) -> list[float]:
    """A's share of the weighted tokens in each whole window while both tenants are being served (and
    before `until`)."""
    if not out.served:
        return []
    start = out.served[0][0]
    last_b = max((t for t, tenant, _ in out.served if tenant == "B"), default=start)
    last_a = max((t for t, tenant, _ in out.served if tenant == "A"), default=start)
    end = min(last_a, last_b, until)
    shares = []
    begin = start + window_s  # the first window fills the seats: not measured
    while begin + window_s <= end:
        a = sum(w for t, tenant, w in out.served if begin <= t < begin + window_s and tenant == "A")
        b = sum(w for t, tenant, w in out.served if begin <= t < begin + window_s and tenant == "B")
        if a + b:
            shares.append(a / (a + b))
        begin += window_s
    return shares


def tiers(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    """One tenant submits a request every tick, faster than the seats free up (saturation: the queue grows),
    every eighth `priority` (slower than they free up: the tier's own queue stays short)."""
    arrivals = [
        Arrival(
            i,
            f"t{i}",
            "A",
            sizes.long_prompt // 2,
            sizes.long_output // 2,
            "priority" if i % 8 == 7 else "default",
        )
        for i in range(sizes.tier_requests)
    ]
    out = drive(engine, arrivals, True, lambda _: [])
    p50 = {tier: percentile(out.ttfts(tier=tier), 50) for tier in ("priority", "default")}
    ratio = p50["default"] / p50["priority"]
    return {"p50_ttft_s": p50, "default_over_priority": ratio, "targets": {"priority_p50_3x_lower": ratio >= 3}}


def measure(engine: LLMEngine, sizes: Sizes, warmup_rounds: int = 1) -> dict[str, Any]:
    """Every workload on `engine` (idle; its scheduler's fair share is replaced per run)."""
    return {
        "flood_and_chat": flood_and_chat(engine, sizes, warmup_rounds),
        "backlog": backlog(engine, sizes),
        "tiers": tiers(engine, sizes),
    }


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


# ---- report -------------------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# streamd bench fairness ({report['date']}, {report['device']}, commit {report['git_commit']})",
        "",
        ("Shared 2-core machine, noisy" if report["device"] == "cpu" else f"One {report['device']} device")
        + ": ratios come from runs in one invocation on one engine.",
    ]
    if report.get("settings"):
        lines += [
            "",
            "Settings over the bench's own (`--set`): "
            + ", ".join(f"`{k} = {v!r}`" for k, v in report["settings"].items()),
        ]
    for model, result in report["models"].items():
        flood, back, tier = result["flood_and_chat"], result["backlog"], result["tiers"]
        flood_met = flood["targets"]
        cpu_ratio = f"{flood['cpu_throughput_fair_over_fcfs']:.3f}"
        lines += [
            f"## model: {model}" + (" (null model: benchmark-only, no forward pass)" if model == "null" else ""),
            "",
            f"Sizes: {result['sizes']}",
            "",
            *markdown_table(
                ["measure", "value", "target", "met"],
                [
                    ["chat p99 TTFT solo / fair / fcfs (s)", fmt(flood["chat_p99_ttft_s"]), "", ""],
                    ["chat TTFT parts solo / fair / fcfs", fmt_parts(flood["chat_ttft_parts"]), "", ""],
                    [
                        f"chat p99 per round, {rounds_note(flood['rounds'], result.get('warmup_rounds'))}",
                        fmt_rounds(flood["chat_p99_ttft_s_by_round"]),
                        "",
                        "",
                    ],
                    ["steps with a prompt chunk solo / fair / fcfs", fmt(flood["prefill_step_share"]), "", ""],
                    [
                        "chat p99 fair / solo",
                        f"{flood['fair_over_solo']:.2f}",
                        "<= 1.5",
                        flood_met["chat_p99_le_1.5x_solo"],
                    ],
                    [
                        "chat p99 fair / fcfs",
                        f"{flood['fair_over_fcfs']:.3f}",
                        "<= 0.2",
                        flood_met["chat_p99_le_0.2x_fcfs"],
                    ],
                    [
                        "tokens/s fair / fcfs (while the queue is not empty)",
                        f"{flood['throughput_fair_over_fcfs']:.3f}",
                        ">= 0.95",
                        flood_met["throughput_ge_0.95x_fcfs"],
                    ],
                    [
                        "tokens/s fair / fcfs (whole run, tail included)",
                        f"{flood['makespan_fair_over_fcfs']:.3f}",
                        "",
                        "",
                    ],
                    ["tokens per CPU second fair / fcfs (queue not empty)", cpu_ratio, "", ""],
                    [
                        f"backlog: A's share per {back['window_s']} s window ({back['windows']} windows)",
                        f"{back['share_A_min']:.3f} .. {back['share_A_max']:.3f}",
                        "0.45 .. 0.55",
                        back["targets"]["shares_50_pm_5"],
                    ],
                    ["tiers: p50 TTFT priority / default (s)", fmt(tier["p50_ttft_s"]), "", ""],
                    [
                        "tiers: default / priority p50",
                        f"{tier['default_over_priority']:.2f}",
                        ">= 3",
                        tier["targets"]["priority_p50_3x_lower"],
                    ],
                    ["longest wait for a first token (s)", f"{flood['max_queue_s']:.2f}", "", ""],
                ],
            ),
            "",
        ]
    return "\n".join(lines)


def fmt(values: dict[str, float]) -> str:
    return " / ".join(f"{v:.3f}" for v in values.values())


def rounds_note(rounds: list[list[str]], warmup_rounds: int | None) -> str:
    warm = "" if warmup_rounds is None else f"after {warmup_rounds} untimed; "
    return warm + "orders " + "; ".join(", ".join(order) for order in rounds)


def fmt_rounds(by_round: dict[str, list[float]]) -> str:
    return " / ".join(", ".join(f"{v:.3f}" for v in values) for values in by_round.values())


def fmt_parts(parts: dict[str, dict[str, float]]) -> str:
    """Per run: p99 queue wait, steps to the first token (median, largest), mean step duration."""
    return " / ".join(
        f"queue {p['queue_p99_s']:.3f} s, {p['steps_p50']:.0f} ({p['steps_max']:.0f}) steps x {p['step_ms']:.1f} ms"
        for p in parts.values()
    )
