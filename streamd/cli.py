"""The `streamd` command line: generate, serve, chat, bench and cluster. Each subcommand lives with its layer;
this module only parses arguments and dispatches."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable

# subcommand -> (module, function adding its arguments, function running it). Modules named here import
# nothing heavy at top level (torch, transformers load only when a command runs), so `--help` is instant.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("streamd.generate_cmd", "add_arguments", "run"),
    "serve": ("streamd.server.entry", "add_serve_arguments", "serve_main"),
    "chat": ("streamd.server.entry", "add_chat_arguments", "chat_main"),
    "bench": ("streamd.bench", "add_arguments", "run"),
    "cluster": ("streamd.cluster", "add_arguments", "cluster_main"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, add_args, run) in COMMANDS.items():
        module = importlib.import_module(module_name)
        doc = getattr(module, run).__doc__ or module.__doc__ or name
        getattr(module, add_args)(sub.add_parser(name, help=doc.strip().splitlines()[0]))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, _, func_name = COMMANDS[args.command]
    func: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module_name), func_name)
    return func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
