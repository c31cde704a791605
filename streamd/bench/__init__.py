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
    "chaos": ("streamd.bench.chaos", "main"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, (module_name, _) in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or name).strip().splitlines()[0]
        module.add_arguments(sub.add_parser(name, help=doc, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))


def run(args: argparse.Namespace) -> int:
    """Benchmarks: memory (CPU), throughput (CUDA, against transformers), serve (load a running server),
    chaos (storms, fuzzing and slow readers against a running server)."""
    module_name, entry = BENCHMARKS[args.benchmark]
    return getattr(importlib.import_module(module_name), entry)(args)
