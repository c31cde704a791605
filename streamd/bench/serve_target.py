"""A `streamd serve` process for `streamd bench serve --offline-baseline`: the real server path (EngineClient,
app, uvicorn) over the engine the benchmark asks for, the null model executor included.

Run as `python -m streamd.bench.serve_target --model null|NAME [--layout L] [--set key=value ...]`.
It prints `LISTENING <port> <engine thread id> <engine process id>` once ready, so the benchmark can reach
it and read its threads' CPU time from the OS; SIGTERM drains and exits as `streamd serve` does. Layouts:
`auto` (`engine.process` as configured: `streamd serve`'s own choice), `thread` (the engine on a thread of the
server process), `process` (the engine in a child process, `ProcessEngine`) and `split` (the same, with the
output processor in the server process: what `auto` picks without tensor parallelism). `--prefill-s-per-token` is
the null model's switch for `streamd bench live` (null_model.py); `--no-progress` (any model) makes its "off"
server, which reports nothing before a first token.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
import time
from collections.abc import Callable

from streamd.bench.null_model import NoProgress, null_engine
from streamd.bench.report import NULL_MODEL
from streamd.config import Config, load_config, parse_value
from streamd.engine.client.engine_process import ProcessEngine
from streamd.engine.client.protocol import EngineClient
from streamd.engine.llm_engine import LLMEngine
from streamd.server.serve import configure_server_logging, engine_for, http_server, run_on_uvloop

LAYOUTS = ("auto", "thread", "process", "split")
WARM_UP_TIMEOUT_S = 120.0  # the warm-up is one token; the model is loaded before


def build_config(model: str, settings: list[str], layout: str | None = None) -> Config:
    """The configuration of `--set` settings; a "thread" or "split" layout decides engine.process ("auto" and
    "process" leave it as configured)."""
    overrides: dict[str, object] = {"server.host": "127.0.0.1", "server.port": 0}
    if model != NULL_MODEL:
        overrides["model.name"] = model
    for item in settings:
        key, _, value = item.partition("=")
        overrides[key] = parse_value(value)
    if layout in ("thread", "split"):
        overrides["engine.process"] = layout == "split"
    return load_config(overrides=overrides)


def build_engine(model: str, config: Config, prefill_s_per_token: float = 0.0, progress: bool = True) -> LLMEngine:
    """The null model (with its switches) or the named model's real engine (`progress` off: it reports
    nothing before a first token, as `bench live`'s "off" server)."""
    if model == NULL_MODEL:
        return null_engine(config, prefill_s_per_token, progress)
    engine = LLMEngine.from_config(config)
    if not progress:
        engine._progress = NoProgress()  # type: ignore[assignment]
    return engine


async def serve(
    model: str, config: Config, layout: str = "thread", build: Callable[[str, Config], LLMEngine] = build_engine
) -> int:
    if layout == "process":  # the output processor stays in the engine's process
        engine: EngineClient = ProcessEngine(
            build, model, config, outputs="engine", batches_ahead=config.engine.batches_ahead
        )
    else:  # as `streamd serve` builds it (`engine.process` set from the layout in build_config)
        engine = engine_for(config, build, model, config)
    server = http_server(config, engine)
    lifecycle = server.lifecycle
    task = asyncio.create_task(server.serve())
    await server.listening.wait()
    deadline = time.monotonic() + WARM_UP_TIMEOUT_S
    while not lifecycle.ready:  # warm-up runs one request through the engine
        if time.monotonic() > deadline or not engine.ready:  # its failure is logged; never hang the bench
            raise SystemExit(f"the benchmark server did not get ready (status {lifecycle.status})")
        await asyncio.sleep(0.05)
    print(f"LISTENING {server.port} {engine.thread_id} {engine.process_id}", flush=True)
    await task
    await engine.shutdown()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=NULL_MODEL)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--layout", choices=LAYOUTS, default="thread")
    parser.add_argument("--prefill-s-per-token", type=float, default=0.0, help="null model: a prefill's sleep")
    parser.add_argument("--no-progress", action="store_true", help="no progress reports before a first token")
    args = parser.parse_args()
    config = build_config(args.model, args.set, args.layout)
    configure_server_logging(config)  # as `streamd serve` does (the benchmark asks for warnings only)
    build = functools.partial(build_engine, prefill_s_per_token=args.prefill_s_per_token, progress=not args.no_progress)
    return run_on_uvloop(serve(args.model, config, args.layout, build))


if __name__ == "__main__":
    sys.exit(main())
