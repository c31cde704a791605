"""Benchmarks runnable from the command line (`streamd bench <name>`); CPU-only ones live here.

It owns the `bench` subcommand's dispatch; each benchmark module brings its own arguments and `run`.
Nothing heavy is imported until a benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module with add_arguments(parser), its entry taking the parsed arguments and returning the exit code)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "memory": ("streamd.bench.memory", "run"),
    "throughput": ("streamd.bench.throughput", "main"),
    "serve": ("streamd.bench.serve", "main"),
    "cluster": ("streamd.bench.cluster", "run"),
    "chaos": ("streamd.bench.chaos", "main"),
    "replicas": ("streamd.bench.replicas", "main"),
    "fairness": ("streamd.bench.fairness", "run"),
    "multiturn": ("streamd.bench.multiturn", "run"),
    "spec": ("streamd.bench.spec", "run"),
    "live": ("streamd.bench.live", "run"),
    "peer": ("streamd.bench.peer", "run"),
    "quality": ("streamd.bench.quality", "run"),
    "quantized": ("streamd.bench.quantized", "run"),
}
EXAMPLES: dict[str, str] = {
    "memory": "streamd bench memory --workloads sharegpt --out /tmp/results",
    "throughput": "streamd bench throughput --device cpu              # ~10 minutes on 2 cores\n"
    "  streamd bench throughput --device cuda --shapes smollm2-135m --out results",
    "serve": "streamd serve &  streamd bench serve --transport sse --concurrency 16 --num-requests 256\n"
    "  streamd bench serve --offline-baseline --levels 64,256 --repeats 3   # starts its own server",
    "cluster": "streamd bench cluster --replicas 1,2,4,8 --out /tmp/results",
    "chaos": "streamd serve &  streamd bench chaos --url http://127.0.0.1:8000 --duration 60",
    "replicas": "streamd bench replicas --replicas 1,2 --concurrency 256 -- --set model.dtype=bfloat16",
    "fairness": "streamd bench fairness --models null,default   # ~5 minutes on 2 cores",
    "multiturn": "streamd bench multiturn --device cpu                # the disk tier vs device-only, minutes\n"
    "  streamd bench multiturn --device cuda --shape llama3.2-3b --conversations 128 --turns 8 --system-tokens 2048 "
    "--turn-tokens 300",
    "spec": "streamd bench spec --out /tmp/results      # speculative decoding on vs off, CPU default model",
    "live": "streamd bench live --scenarios proxy,first-frame,overhead   # issue 32's targets, null model, minutes",
    "quality": "streamd bench quality --kv-cache-dtype int8 --num-prompts 100 --max-tokens 64   # minutes on 2 cores",
    "quantized": "streamd bench quantized --shapes llama3.1-8b,llama3.2-1b   # one H100: FP8 weights and KV vs bf16",
    "peer": "llama-server -m MODEL.gguf --port 8080 --parallel 32 -c 32768 &\n"
    "  streamd bench peer --url http://127.0.0.1:8080 --concurrency 1,8,32 --rounds 3",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, _) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or name).strip().splitlines()[0]
        module.add_arguments(
            sub.add_parser(
                name,
                help=doc,
                description=module.__doc__,
                epilog=f"example:\n  {EXAMPLES[name]}" if name in EXAMPLES else None,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )


def run(args: argparse.Namespace) -> int:
    """Benchmarks: each one below with what it measures; `streamd bench <name> --help` gives its arguments
    and an example."""
    # (No list of the benchmarks here: the subcommands' help is built from `BENCHMARKS`, this one fell behind.)
    module_name, entry = BENCHMARKS[args.benchmark]
    return getattr(importlib.import_module(module_name), entry)(args)
