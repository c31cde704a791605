"""Benchmarks runnable from the command line (`streamd bench <name>`); CPU-only ones live here.

It owns the `bench` subcommand's dispatch; each benchmark module brings its own arguments and `run`.
Nothing heavy is imported until a benchmark runs.
"""

from __future__ import annotations

import argparse
import importlib

# name -> module with add_arguments(parser) and run(args) -> int
BENCHMARKS = {"memory": "streamd.bench.memory"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        doc = (module.__doc__ or name).strip().splitlines()[0]
        module.add_arguments(sub.add_parser(name, help=doc, description=module.__doc__,
                                            formatter_class=argparse.RawDescriptionHelpFormatter))


def run(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.benchmark]).run(args)
