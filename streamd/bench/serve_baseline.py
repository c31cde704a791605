"""`streamd bench serve --offline-baseline`: what serving costs on top of the engine, measured in one run.

It starts its own servers (`serve_target`, the real server path over the chosen engine: by default the null
model executor, so the model's own cost is taken out), and, alternating in each repetition, measures:

- the offline rate of the same engine configuration and prompts in this process (closed loop at the same
  concurrency, `LLMEngine.step()` directly);
- the served rate over WebSocket (`streamd.v2` framing) and over SSE, with this process as the client,
  for each server layout asked for (`--layouts`, default `thread,split`: the engine on a thread of the
  server process, as `streamd serve` by default, and in its own process with detokenizing in the
  server's, as `engine.process = true`; `process` keeps the output processor in the engine's).

Per run it records TTFT and inter-token latency percentiles, the server's CPU time per delivered token
(engine thread, event loop, whole process, read from /proc) and the client's. Reports the median of the
repetitions as `serve-<date>-<device>.json` and `.md` under `--out`.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from streamd import heap
from streamd.bench.report import NULL_MODEL, add_out_argument, git_commit, save_report

_TICK = os.sysconf("SC_CLK_TCK")
# Engine settings of both the offline run and the server: a pool that holds every stream of the
# workload (no preemption), no swap (its start-up measurement is not what is measured here).
DEFAULT_SETTINGS = (
    "cache.num_kv_blocks=4096",
    "cache.num_swap_blocks=0",
    'scheduler.preemption_mode="recompute"',
    'logging.level="warning"',
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("offline baseline (starts its own server)")
    group.add_argument(
        "--offline-baseline",
        action="store_true",
        help="measure offline vs served rate of one engine configuration in one run",
    )
    group.add_argument(
        "--baseline-model",
        default=NULL_MODEL,
        help="'null' (the benchmark-only null model executor) or a model name/directory",
    )
    group.add_argument("--levels", default="64,256", help="concurrency levels, comma-separated")
    group.add_argument(
        "--rates",
        default="",
        help="Poisson arrival rates (requests/s), comma-separated; "
        "each is served with --rate-requests requests and compared with the largest level's offline rate",
    )
    group.add_argument("--rate-requests", type=int, default=512)
    group.add_argument("--transports", default="ws,sse")
    group.add_argument("--repeats", type=int, default=3)
    group.add_argument(
        "--requests-per-stream",
        type=int,
        default=4,
        help="requests per concurrent stream in each run (num requests = level x this)",
    )
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="settings",
        help="engine/server setting for both runs (repeatable)",
    )
    group.add_argument(
        "--layouts",
        default="thread,split",
        help="server layouts, comma-separated: 'thread' (the engine on a thread of the server "
        "process), 'process' (the engine in a child process: the issue-9 prototype), 'split' "
        "(the same, detokenizing in the server process); each run alternates them",
    )
    add_out_argument(parser)


@dataclass(slots=True)
class ServedRun:
    transport: str
    layout: str  # "thread": engine thread in the server process; "process"/"split": engine in its own process
    engine_process: bool  # what the server reported: its engine runs in a process of its own
    concurrency: int | None  # closed loop; None for a Poisson run
    rate: float | None  # Poisson arrivals per second; None for a closed loop
    offline_tok_s: float
    served_tok_s: float
    ratio: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    server_cpu_us_per_token: float
    engine_cpu_us_per_token: float
    loop_cpu_us_per_token: float
    client_cpu_us_per_token: float
    offline_cpu_us_per_token: float
    failed: int
    errors: list[str]


class ServerProcess:
    """The benchmark's own server, and the CPU time of its threads."""

    def __init__(self, model: str, settings: list[str], layout: str = "thread", extra: Sequence[str] = ()) -> None:
        """`extra`: more serve_target arguments (the null model's switches)."""
        self.layout = layout
        cmd = [sys.executable, "-m", "streamd.bench.serve_target", "--model", model, "--layout", layout, *extra]
        for item in settings:
            cmd += ["--set", item]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("LISTENING"):
            self.proc.kill()
            raise RuntimeError(f"the benchmark server did not start (exit {self.proc.wait()})")
        _, port, engine_tid, engine_pid = line.split()
        self.url, self.engine_tid, self.engine_pid = f"http://127.0.0.1:{port}", int(engine_tid), int(engine_pid)

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far: the event loop (main thread), the engine thread, and the whole server (both
        processes when the engine runs in its own)."""
        pid, engine_pid = self.proc.pid, self.engine_pid
        total = _thread_cpu(pid, None) + (_thread_cpu(engine_pid, None) if engine_pid != pid else 0.0)
        return {"loop": _thread_cpu(pid, pid), "engine": _thread_cpu(engine_pid, self.engine_tid), "process": total}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _thread_cpu(pid: int, tid: int | None) -> float:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def offline_rate(engine: Any, prompts: list[str], max_tokens: int, concurrency: int) -> tuple[float, float]:
    """Tokens/s and CPU µs per token of `engine.step()` driving the prompts, `concurrency` in flight."""
    from streamd.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
    queue, in_flight, tokens = list(reversed(prompts)), 0, 0
    start, cpu = time.perf_counter(), time.thread_time()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            engine.add_request(f"off{len(queue)}-{time.perf_counter_ns()}", queue.pop(), params)
            in_flight += 1
        for delta in engine.step():
            tokens += delta.num_new_tokens
            in_flight -= delta.finished
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return tokens / elapsed, cpu / tokens * 1e6


async def served_run(
    args: argparse.Namespace,
    server: ServerProcess,
    transport: str,
    concurrency: int | None,
    num_requests: int,
    seed: int,
    rate: float | None = None,
) -> tuple[dict[str, Any], dict[str, float], float]:
    """The served run: `num_requests` of the prompts `seed` makes (the offline run's)."""
    from streamd.bench.load import report, run_load

    run_args = copy.copy(args)
    run_args.url, run_args.transport, run_args.concurrency, run_args.rate = server.url, transport, concurrency, rate
    run_args.num_requests, run_args.framing, run_args.seed = num_requests, "v2", seed
    before, client_before = server.cpu_seconds(), _own_cpu()
    timings, duration = await run_load(run_args)
    after, client_cpu = server.cpu_seconds(), _own_cpu() - client_before
    return report(timings, duration, run_args), {k: after[k] - before[k] for k in after}, client_cpu


def main(args: argparse.Namespace) -> int:
    from streamd.bench.load import synthetic_prompts
    from streamd.bench.serve_target import build_config, build_engine
    from streamd.server.serve import run_on_uvloop

    settings = [*DEFAULT_SETTINGS, *args.settings]
    levels = [int(x) for x in args.levels.split(",")]
    rates = [float(x) for x in args.rates.split(",") if x]
    transports = args.transports.split(",")
    engine = build_engine(args.baseline_model, build_config(args.baseline_model, settings))
    heap.settle()  # as the server does after its warm-up: the offline rate pays the same collector
    servers = {layout: ServerProcess(args.baseline_model, settings, layout) for layout in args.layouts.split(",")}
    raw: list[ServedRun] = []
    pairs = itertools.count()  # each offline/served pair gets prompts neither engine has seen (no prefix hits)
    try:
        for _repeat in range(args.repeats):
            for level in levels:
                for transport in transports:
                    for _layout, server in servers.items():
                        seed = args.seed + 1000 * next(pairs)
                        prompts = synthetic_prompts(level * args.requests_per_stream, args.prompt_words, seed)
                        offline, offline_cpu = offline_rate(engine, prompts, args.max_tokens, level)
                        result, cpu, client_cpu = run_on_uvloop(
                            served_run(args, server, transport, level, len(prompts), seed)
                        )
                        raw.append(
                            _run_record(transport, server, level, None, offline, offline_cpu, result, cpu, client_cpu)
                        )
                        print(_line(raw[-1]), flush=True)
            for rate in rates:
                for transport in transports:
                    for _layout, server in servers.items():
                        seed = args.seed + 1000 * next(pairs)
                        result, cpu, client_cpu = run_on_uvloop(
                            served_run(args, server, transport, None, args.rate_requests, seed, rate)
                        )
                        raw.append(
                            _run_record(transport, server, None, rate, offline, offline_cpu, result, cpu, client_cpu)
                        )
                        print(_line(raw[-1]), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    report = _summary(args, raw)
    stem = save_report(report, args.out, "serve", _markdown(report))
    print(f"wrote {stem}.json and .md")
    return 0


def _run_record(
    transport: str,
    server: ServerProcess,
    level: int | None,
    rate: float | None,
    offline: float,
    offline_cpu: float,
    result: dict[str, Any],
    cpu: dict[str, float],
    client_cpu: float,
) -> ServedRun:
    tokens = max(1, result["output_tokens"])
    served = result["output_token_throughput"]
    return ServedRun(
        transport,
        server.layout,
        server.engine_pid != server.proc.pid,
        level,
        rate,
        offline,
        served,
        served / offline,
        result["ttft_s"]["p50"],
        result["ttft_s"]["p99"],
        result["itl_s"]["p50"],
        result["itl_s"]["p99"],
        cpu["process"] / tokens * 1e6,
        cpu["engine"] / tokens * 1e6,
        cpu["loop"] / tokens * 1e6,
        client_cpu / tokens * 1e6,
        offline_cpu,
        result["failed"],
        result["errors"],
    )


def _line(run: ServedRun) -> str:
    load = f"c={run.concurrency}" if run.rate is None else f"rate={run.rate:g}/s"
    return (
        f"{run.transport:>4} {run.layout:<7} {load:<10} offline {run.offline_tok_s:8.0f} tok/s  served "
        f"{run.served_tok_s:8.0f} tok/s  ratio {run.ratio:.2f}  server {run.server_cpu_us_per_token:.1f} µs/tok "
        f"(engine {run.engine_cpu_us_per_token:.1f}, loop {run.loop_cpu_us_per_token:.1f})  client "
        f"{run.client_cpu_us_per_token:.1f} µs/tok  failed {run.failed}"
    )


def _summary(args: argparse.Namespace, raw: list[ServedRun]) -> dict[str, Any]:
    runs = []
    for key in dict.fromkeys((r.transport, r.layout, r.concurrency, r.rate) for r in raw):
        group = [asdict(r) for r in raw if (r.transport, r.layout, r.concurrency, r.rate) == key]
        median = {
            k: (
                statistics.median(g[k] for g in group)
                if isinstance(group[0][k], (int, float))
                and not isinstance(group[0][k], bool)
                and all(g[k] is not None for g in group)
                else group[0][k]
            )
            for k in group[0]
        }
        runs.append(median)
    return {
        "benchmark": "serve --offline-baseline",
        "model": args.baseline_model,
        "model_note": "null = benchmark-only executor: no forward pass, uniform random tokens of the real "
        "vocabulary; everything else real"
        if args.baseline_model == NULL_MODEL
        else "",
        "device": _device_name(),
        "cpu_cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        "git_commit": git_commit(),
        "max_tokens": args.max_tokens,
        "prompt_words": args.prompt_words,
        "repeats": args.repeats,
        "statistic": "median of repeats",
        "runs": runs,
        "raw": [asdict(r) for r in raw],
    }


def _device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# streamd bench serve --offline-baseline ({report['date']}, {report['device']}, "
        f"commit {report['git_commit']})",
        "",
        f"Model: `{report['model']}`. {report['model_note']}",
        "",
        f"{report['max_tokens']} output tokens per request, median of {report['repeats']} runs.",
        "",
        "| transport | layout | load | offline tok/s | served tok/s | served/offline | TTFT p50/p99 ms | "
        "ITL p50/p99 ms | server µs/tok (engine, loop) | client µs/tok | offline µs/tok |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        ms = lambda v: "-" if v is None else f"{v * 1000:.1f}"  # noqa: E731
        load = f"{r['concurrency']} streams" if r["rate"] is None else f"Poisson {r['rate']:g}/s"
        lines.append(
            f"| {r['transport']} | {r['layout']} | {load} | {r['offline_tok_s']:.0f} | "
            f"{r['served_tok_s']:.0f} | "
            f"{r['ratio']:.2f} | {ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])} | {ms(r['itl_p50_s'])} / "
            f"{ms(r['itl_p99_s'])} | {r['server_cpu_us_per_token']:.1f} ({r['engine_cpu_us_per_token']:.1f}, "
            f"{r['loop_cpu_us_per_token']:.1f}) | {r['client_cpu_us_per_token']:.1f} | "
            f"{r['offline_cpu_us_per_token']:.1f} |"
        )
    return "\n".join(lines) + "\n"
