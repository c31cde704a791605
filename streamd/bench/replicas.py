"""`streamd bench replicas`: served tokens/s of 1, 2, ... replicas behind the cluster's router, same load.

Issue 26: one replica per GPU should scale with the GPUs. For each replica count this starts `streamd
cluster`'s own pieces (`running_cluster`: replica i pinned to GPU i, the shared response store, vllm-router),
without nginx: the load is HTTP + SSE, which the router carries (nginx only adds the WebSocket routes). Then
`--clients` processes of `streamd bench serve --transport sse` share `--concurrency` streams against the
router, so one Python client's parsing never bounds the number. A count's rate is the sum of the clients'
output tokens over the longest client's wall time; each count is reported beside the first count's rate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from streamd.bench.report import add_out_argument, markdown_table, report_header, save_report
from streamd.cli.cluster import ClusterSpec, count_gpus, running_cluster


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", default="1,2", help="comma-separated replica counts, the first the baseline")
    parser.add_argument("--concurrency", type=int, default=256, help="streams in flight over all clients")
    parser.add_argument(
        "--scale-load", action="store_true", help="--concurrency per replica (the load grows with the replicas)"
    )
    parser.add_argument("--requests-per-stream", type=int, default=3, help="requests each stream sends in turn")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--clients", type=int, default=4, help="load-generating processes")
    parser.add_argument("--tp", type=int, default=1, help="GPUs per replica")
    parser.add_argument("--first-port", type=int, default=18000)
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--direct", action="store_true", help="clients load the replicas directly (client i: replica i mod R)"
    )
    parser.add_argument("--log-dir", help="keep each count's replica and router logs under this folder")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: `streamd serve` arguments")
    add_out_argument(parser)


def main(args: argparse.Namespace) -> int:
    counts = [int(n) for n in args.replicas.split(",")]
    gpus = count_gpus()
    runs = [_measure(args, n, gpus) for n in counts]
    base = runs[0]["output_tok_s"]
    for run in runs:
        run["vs_first"] = run["output_tok_s"] / base if base else 0.0
    report = {**report_header(_device_name(gpus)), "settings": _settings(args), "runs": runs}
    print(json.dumps(runs, indent=2))
    name = "replicas" + ("-direct" if args.direct else "") + ("-scaled" if args.scale_load else "")
    save_report(report, args.out, name, _markdown(report))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _measure(args: argparse.Namespace, replicas: int, gpus: int) -> dict[str, Any]:
    """One replica count: the cluster up, the clients run together, the cluster down."""
    port = args.first_port
    spec = ClusterSpec(replicas, port, port + 1, port + 2, port + 10, "round_robin", _serve_args(args), args.tp, gpus)
    spec.check()
    logs = None
    if args.log_dir:
        logs = Path(args.log_dir) / f"replicas-{replicas}"
        logs.mkdir(parents=True, exist_ok=True)
    with running_cluster(spec, args.ready_timeout_s, logs, websockets=False):
        ports = spec.replica_ports if args.direct else [spec.router_port]
        streams = args.concurrency * (replicas if args.scale_load else 1)
        results = _run_clients(args, [f"http://127.0.0.1:{p}" for p in ports], streams)
    tokens = sum(r["output_tokens"] for r in results)
    wall = max(r["duration_s"] for r in results)
    return {
        "replicas": replicas,
        "streams": streams,
        "output_tok_s": tokens / wall,
        "output_tokens": tokens,
        "wall_s": wall,
        "failed": sum(r["failed"] for r in results),
        "ttft_p50_s": max(r["ttft_s"]["p50"] or 0.0 for r in results),
        "itl_p50_s": max(r["itl_s"]["p50"] or 0.0 for r in results),
    }


def _run_clients(args: argparse.Namespace, urls: list[str], streams: int) -> list[dict[str, Any]]:
    """`--clients` load processes started together (client i on `urls[i % len(urls)]`); their JSON reports."""
    per_client = max(1, streams // args.clients)
    with tempfile.TemporaryDirectory() as tmp:
        paths = [Path(tmp) / f"client-{i}.json" for i in range(args.clients)]
        procs = [
            subprocess.Popen(_client_command(args, urls[i % len(urls)], per_client, i, p)) for i, p in enumerate(paths)
        ]
        for proc in procs:
            proc.wait()
        return [json.loads(p.read_text()) for p in paths]


def _client_command(args: argparse.Namespace, url: str, streams: int, seed: int, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "streamd.cli.main", "bench", "serve", "--url", url, "--transport", "sse",
        "--concurrency", str(streams), "--num-requests", str(streams * args.requests_per_stream),
        "--max-tokens", str(args.max_tokens), "--prompt-words", str(args.prompt_words),
        "--seed", str(seed), "--json", str(out),
    ]  # fmt: skip


def _device_name(gpus: int) -> str:
    """The GPUs as nvidia-smi names them ("2x NVIDIA H100 80GB HBM3"; no CUDA here), or "cpu"."""
    if not gpus:
        return "cpu"
    names = subprocess.run(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
    ).stdout.split("\n")
    return f"{gpus}x {names[0].strip()}"


def _serve_args(args: argparse.Namespace) -> list[str]:
    return [a for a in args.serve_args if a != "--"]


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("concurrency", "requests_per_stream", "max_tokens", "prompt_words", "clients", "tp", "direct", "scale_load")
    return {**{k: getattr(args, k) for k in keys}, "serve_args": _serve_args(args)}


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Replicas behind the router, {report['device']}, {report['date']} ({report['git_commit']})",
        "",
        f"Settings: {report['settings']}. "
        + ("Clients on the replicas directly" if report["settings"]["direct"] else "vllm-router round_robin")
        + ", HTTP + SSE (no nginx).",
        "",
        *markdown_table(
            ["replicas", "streams", "output tok/s", "vs first", "TTFT p50 s", "ITL p50 ms", "failed"],
            (
                [
                    r["replicas"],
                    r["streams"],
                    f"{r['output_tok_s']:,.0f}",
                    f"{r['vs_first']:.2f}x",
                    f"{r['ttft_p50_s']:.3f}",
                    f"{r['itl_p50_s'] * 1000:.1f}",
                    r["failed"],
                ]
                for r in report["runs"]
            ),
        ),
    ]
    return "\n".join(lines) + "\n"
