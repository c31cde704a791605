"""Load a running server (`streamd bench serve`): Poisson arrivals or a fixed concurrency, over WebSocket or SSE.

Reports request and output-token throughput and p50/p90/p99 of time to first token (TTFT), inter-token
latency (ITL, every gap between consecutive tokens) and end-to-end latency (E2E), as a table and as JSON.
Prompts are synthetic (seeded), and `ignore_eos` makes every request produce exactly `--max-tokens`, so
runs are comparable (the clients are in load.py).

`--offline-baseline` (serve_baseline.py) starts its own server, measures the offline rate of the same
engine and prompts in the same invocation, and reports served/offline ratios and server CPU per token.

Example: `streamd bench serve --url http://127.0.0.1:8000 --concurrency 64 --max-tokens 128`
"""

from __future__ import annotations

import argparse

from streamd.bench import serve_baseline
from streamd.bench.load import format_table, report, run_load
from streamd.bench.report import add_json_argument, write_json
from streamd.server.serve import run_on_uvloop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--transport", choices=("ws", "sse"), default="ws")
    parser.add_argument("--framing", choices=("v1", "v2"), default="v2", help="WebSocket framing")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="Poisson arrival rate, requests/s")
    load.add_argument("--concurrency", type=int, help="requests kept in flight (default 8 without --rate)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=64, help="words per synthetic prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--connections", type=int, default=0, help="WebSocket pool size (0: automatic)")
    parser.add_argument("--api-key")
    parser.add_argument("--model", help="model name for HTTP requests (default: the server's first)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--continuous-usage", action="store_true", help="SSE: every chunk carries the usage (continuous_usage_stats)"
    )
    add_json_argument(parser)
    serve_baseline.add_arguments(parser)


def main(args: argparse.Namespace) -> int:
    if args.offline_baseline:
        return serve_baseline.main(args)
    timings, duration = run_on_uvloop(run_load(args))
    result = report(timings, duration, args)
    print(format_table(result))
    write_json(result, args.json)
    return 0 if result["completed"] else 1
