"""Many tenants on one engine: a flood beside a chat, two backlogged tenants, and service tiers.

`streamd bench fairness` drives the real LLMEngine in this process (`--models null`: the null model,
benchmark-only, see null_model.py; `default`: the default model on the CPU), each workload under
`scheduler.scheduling = "fair"` and `"fcfs"` on the same engine in one invocation (the scheduler's fair share
is rebuilt between runs; prefix caching is off so no run warms another). Arrivals are on the driver's ticks
(one engine step per tick while there is work), so every run sees the same arrival pattern; times are wall
seconds. The targets (issue 30) are checked beside the numbers:

- flood and chat: tenant A submits `flood` long requests at once, tenant B a short one every few ticks;
  B's p99 TTFT under fair <= 1.5x its solo run and <= 0.2x its TTFT under fcfs; throughput (all tokens over
  the run's wall time) fair >= 0.95x fcfs.
- backlog: A (long requests) and B (short) both keep a queue; each tenant's share of the weighted tokens
  (prompt 1, output 2: what the fair share equalizes) in every `--window-s` window is 50 +- 5%.
- tiers: one tenant saturates the engine, a quarter of its requests `service_tier: "priority"`; their p50
  TTFT is >= 3x lower than the default ones'.
"""

from __future__ import annotations

import argparse
import statistics
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from streamd.bench.report import add_out_argument, markdown_table, report_header, save_report
from streamd.config import load_config
from streamd.engine.core.fairness import OUTPUT_WEIGHT, PROMPT_WEIGHT, FairShare
from streamd.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # (the CLI imports this module to build its parser: no torch there)
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

    def ttfts(self, tenant: str | None = None, tier: str | None = None) -> list[float]:
        return sorted(t.ttft for t in self.timings.values() if tenant in (None, t.tenant) and tier in (None, t.tier))


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
    add_out_argument(parser)
    parser.add_argument("--no-write", action="store_true", help="print only")


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {**report_header("cpu"), "benchmark": "fairness", "models": {}}
    for name in args.models.split(","):
        sizes = sizes_for(name, args.light, args.window_s)
        engine = build_engine(name, sizes)
        try:
            report["models"][name] = {"sizes": asdict(sizes), **measure(engine, sizes)}
        finally:
            engine.executor.shutdown()
    text = markdown(report)
    print(text)
    if not args.no_write:
        print(f"wrote {save_report(report, args.out, 'fairness', text)}.{{json,md}}")
    return 0


def sizes_for(model: str, light: bool, window_s: float | None) -> Sizes:
    if model not in FULL:
        raise ValueError(f"--models: unknown model {model!r} (null or default)")
    sizes = LIGHT if light else FULL[model]
    return sizes if window_s is None else replace(sizes, window_s=window_s)


def build_engine(model: str, sizes: Sizes) -> LLMEngine:
    overrides = {
        "model.device": "cpu",
        "model.dtype": "float32",
        "cache.enable_prefix_caching": False,
        "cache.num_kv_blocks": 4096,
        "cache.num_swap_blocks": 0,
        "scheduler.max_num_seqs": sizes.seats,
        "scheduler.max_num_batched_tokens": 1024,
    }
    config = load_config(overrides=overrides, environ={})
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
    pending, out, tick = sorted(arrivals, key=lambda a: a.tick), Run(), 0
    start = time.perf_counter()
    while True:
        pending.extend(refill(tick))
        if not pending and not engine.has_unfinished_requests():
            break
        while pending and pending[0].tick <= tick:
            submit(engine, pending.pop(0), out)
        tick += 1
        if engine.has_unfinished_requests():
            step(engine, out)
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
        if tokens and timing.first_token is None:
            timing.first_token = time.perf_counter()
            prompt = PROMPT_WEIGHT * delta.num_prompt_tokens
            weighted[timing.tenant] = weighted.get(timing.tenant, 0.0) + prompt
            out.tokens += delta.num_prompt_tokens
        weighted[timing.tenant] = weighted.get(timing.tenant, 0.0) + OUTPUT_WEIGHT * tokens
        out.tokens += tokens
    now = time.perf_counter()
    out.served.extend((now, tenant, weight) for tenant, weight in weighted.items())


# ---- workloads ----------------------------------------------------------------------------------------


def flood_and_chat(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    chats = [Arrival(2 + i * sizes.chat_every, f"b{i}", "B", 24, 8) for i in range(sizes.chats)]
    flood = [Arrival(0, f"a{i}", "A", sizes.long_prompt, sizes.long_output) for i in range(sizes.flood)]
    solo = drive(engine, chats, True, lambda _: [])
    fair = drive(engine, flood + chats, True, lambda _: [])
    fcfs = drive(engine, flood + chats, False, lambda _: [])
    p99 = {name: percentile(r.ttfts("B"), 99) for name, r in (("solo", solo), ("fair", fair), ("fcfs", fcfs))}
    throughput = {name: r.tokens / r.seconds for name, r in (("fair", fair), ("fcfs", fcfs))}
    result: dict[str, Any] = {
        "chat_p99_ttft_s": p99,
        "flood_p50_ttft_s": {name: percentile(r.ttfts("A"), 50) for name, r in (("fair", fair), ("fcfs", fcfs))},
        "tokens_per_s": throughput,
        "fair_over_solo": p99["fair"] / p99["solo"],
        "fair_over_fcfs": p99["fair"] / p99["fcfs"],
        "throughput_fair_over_fcfs": throughput["fair"] / throughput["fcfs"],
        "max_queue_s": max(max(r.ttfts()) for r in (fair, fcfs)),
    }
    result["targets"] = {
        "chat_p99_le_1.5x_solo": result["fair_over_solo"] <= 1.5,
        "chat_p99_le_0.2x_fcfs": result["fair_over_fcfs"] <= 0.2,
        "throughput_ge_0.95x_fcfs": result["throughput_fair_over_fcfs"] >= 0.95,
    }
    return result


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


def measure(engine: LLMEngine, sizes: Sizes) -> dict[str, Any]:
    """Every workload on `engine` (idle; its scheduler's fair share is replaced per run)."""
    return {
        "flood_and_chat": flood_and_chat(engine, sizes),
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
        "Shared 2-core machine, noisy: ratios come from runs in one invocation on one engine.",
    ]
    for model, result in report["models"].items():
        flood, back, tier = result["flood_and_chat"], result["backlog"], result["tiers"]
        flood_met = flood["targets"]
        lines += [
            f"## model: {model}" + (" (null model: benchmark-only, no forward pass)" if model == "null" else ""),
            "",
            f"Sizes: {result['sizes']}",
            "",
            *markdown_table(
                ["measure", "value", "target", "met"],
                [
                    ["chat p99 TTFT solo / fair / fcfs (s)", fmt(flood["chat_p99_ttft_s"]), "", ""],
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
                        "tokens/s fair / fcfs",
                        f"{flood['throughput_fair_over_fcfs']:.3f}",
                        ">= 0.95",
                        flood_met["throughput_ge_0.95x_fcfs"],
                    ],
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
