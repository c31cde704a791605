"""`streamd bench peer`: one OpenAI streaming load against another server and against streamd, side by side.

The peer is any server with OpenAI's streaming `/v1/completions` (llama.cpp's `llama-server`, vLLM, SGLang);
streamd is started here (`serve_target`, the real server path with `streamd serve`'s engine layout; `--set`
settings) on the same model file, or reached at `--streamd-url`. Every level of `--concurrency` runs `--rounds`
times, the two servers alternating which goes first, with the same seeded prompts, `ignore_eos` and
`--max-tokens` output tokens per request (load.py's SSE client: one `data:` event is one delta; the usage chunk,
where a server sends one, gives the exact count). Reported per level: the median output tokens/s, TTFT p50 and
ITL p50 of each, and their ratios (streamd / peer). How to build llama.cpp's server here: docs/models.md.

Example: `streamd bench peer --url http://127.0.0.1:8080 --concurrency 1,8,32 --rounds 3`
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from streamd.bench.load import (
    SSEClient,
    Timing,
    closed_loop,
    first_token_times,
    inter_token_gaps,
    percentiles,
    synthetic_prompts,
)
from streamd.bench.report import BenchError, add_out_argument, markdown_table, report_header, save_report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the peer's base URL (e.g. llama-server's)")
    parser.add_argument("--streamd-url", help="a running streamd to compare (default: start one here)")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated streams kept in flight")
    parser.add_argument("--rounds", type=int, default=3, help="runs per level (the order alternates)")
    parser.add_argument("--requests-per-stream", type=int, default=2, help="requests per stream per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=100, help="words per synthetic prompt (~1.5 tokens each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="settings of streamd's server")
    add_out_argument(parser)


@dataclass(frozen=True, slots=True)
class Run:
    server: str  # "streamd" | "peer"
    concurrency: int
    round: int
    output_tok_s: float
    ttft_p50_s: float | None
    completed: int
    failed: int
    itl_p50_s: float | None = None  # the gaps between a request's tokens (one event each), over its requests


def run(args: argparse.Namespace) -> int:
    levels = [int(c) for c in args.concurrency.split(",")]
    if min(levels) < 1 or args.rounds < 1:
        raise BenchError("--concurrency levels and --rounds must be >= 1")
    with _streamd(args) as streamd_url:
        urls = {"peer": args.url.rstrip("/"), "streamd": streamd_url}
        runs = asyncio.run(_all_runs(urls, levels, args))
    report = {**report_header("cpu"), "argv": sys.argv[1:], "peer_url": args.url, "runs": [asdict(r) for r in runs]}
    report["levels"] = [_level(runs, c) for c in levels]
    stem = save_report(report, args.out, "cpu-peer", markdown(report))
    print("\n".join(markdown_table(*_table(report["levels"]))))
    print(f"wrote {stem}.json and .md")
    return 0 if all(r.failed == 0 for r in runs) else 1


@contextlib.contextmanager
def _streamd(args: argparse.Namespace) -> Iterator[str]:
    """streamd's server for the run: the one at --streamd-url, or a `serve_target` started on the default model."""
    if args.streamd_url:
        yield str(args.streamd_url).rstrip("/")
        return
    from streamd.bench.serve_baseline import ServerProcess
    from streamd.engine.worker.model_loader import default_gguf_path

    server = ServerProcess(str(default_gguf_path()), list(args.set), layout="auto")  # as `streamd serve` runs
    try:
        yield server.url
    finally:
        server.stop()


async def _all_runs(urls: dict[str, str], levels: list[int], args: argparse.Namespace) -> list[Run]:
    async with contextlib.AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(SSEClient(url, None, None)) for name, url in urls.items()}
        for client in clients.values():
            await client.generate("Warm up.", 4)  # first-request costs (kernel set-up, caches) stay out of the runs
        runs = []
        for r in range(args.rounds):
            for i, level in enumerate(levels):
                order = ["peer", "streamd"] if (r + i) % 2 == 0 else ["streamd", "peer"]
                prompts = synthetic_prompts(level * args.requests_per_stream, args.prompt_words, args.seed + r)
                for name in order:
                    runs.append(await _one(name, clients[name], prompts, level, r, args.max_tokens))
    return runs


async def _one(name: str, client: SSEClient, prompts: list[str], level: int, round_: int, max_tokens: int) -> Run:
    loop = asyncio.get_running_loop()
    start = loop.time()
    timings: list[Timing] = await closed_loop(client, prompts, max_tokens, level)
    duration = loop.time() - start
    ok = [t for t in timings if t.error is None]
    ttft = percentiles(first_token_times(ok))["p50"]
    itl = percentiles(inter_token_gaps(ok))["p50"]
    tok_s = sum(t.tokens for t in ok) / duration
    run = Run(name, level, round_, tok_s, ttft, len(ok), len(timings) - len(ok), itl)
    print(f"round {round_} concurrency {level} {name}: {tok_s:.1f} tok/s, TTFT p50 {ttft}, ITL p50 {itl}", flush=True)
    return run


def _level(runs: list[Run], level: int) -> dict[str, Any]:
    """The level's medians over rounds, per server, and streamd's ratios to the peer."""
    out: dict[str, Any] = {"concurrency": level}
    for name in ("streamd", "peer"):
        mine = [r for r in runs if r.concurrency == level and r.server == name]
        out[f"{name}_tok_s"] = statistics.median(r.output_tok_s for r in mine)
        ttfts = [r.ttft_p50_s for r in mine if r.ttft_p50_s is not None]
        out[f"{name}_ttft_p50_s"] = statistics.median(ttfts) if ttfts else None
        itls = [r.itl_p50_s for r in mine if r.itl_p50_s is not None]
        out[f"{name}_itl_p50_s"] = statistics.median(itls) if itls else None
    out["tok_s_ratio"] = out["streamd_tok_s"] / out["peer_tok_s"] if out["peer_tok_s"] else None
    peer_ttft, own_ttft = out["peer_ttft_p50_s"], out["streamd_ttft_p50_s"]
    out["ttft_ratio"] = own_ttft / peer_ttft if peer_ttft and own_ttft is not None else None
    return out


def _table(levels: list[dict[str, Any]]) -> tuple[list[str], list[list[object]]]:
    header = ["streams", "streamd tok/s", "peer tok/s", "streamd/peer", "TTFT p50 streamd", "TTFT p50 peer"]
    header += ["ITL p50 streamd", "ITL p50 peer"]
    rows: list[list[object]] = [
        [
            lv["concurrency"],
            f"{lv['streamd_tok_s']:.1f}",
            f"{lv['peer_tok_s']:.1f}",
            "-" if lv["tok_s_ratio"] is None else f"{lv['tok_s_ratio']:.2f}x",
            _ms(lv["streamd_ttft_p50_s"]),
            _ms(lv["peer_ttft_p50_s"]),
            _ms(lv.get("streamd_itl_p50_s"), 1),
            _ms(lv.get("peer_itl_p50_s"), 1),
        ]
        for lv in levels
    ]
    return header, rows


def _ms(seconds: float | None, digits: int = 0) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f} ms"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# streamd bench peer ({report['date']}, commit {report['git_commit']}, {report['device']})",
        "",
        f"Peer: {report['peer_url']}. Command: `streamd {' '.join(report['argv'])}`. Medians over rounds "
        "(order alternating); output tokens/s over each run's wall time; TTFT p50 of its requests; ITL p50 of "
        "the gaps between a request's token events.",
        "",
        *markdown_table(*_table(report["levels"])),
        "",
    ]
    return "\n".join(lines)
