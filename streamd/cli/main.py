"""The `streamd` command line: generate, serve, chat, bench and cluster. Each subcommand has its module
(`streamd/cli/<name>.py`; `bench` is `streamd.bench`'s); this module only parses arguments, dispatches, and
turns any error into one line on stderr (exit status 2 for a bad setting or argument, 1 for a failure while
running; `--debug` shows the traceback instead)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# subcommand -> (module, function adding its arguments, function running it). Modules named here import
# nothing heavy at top level (torch, transformers load only when a command runs), so `--help` is instant.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "generate": ("streamd.cli.generate", "add_arguments", "run"),
    "serve": ("streamd.cli.serve", "add_serve_arguments", "serve_main"),
    "chat": ("streamd.cli.chat", "add_chat_arguments", "chat_main"),
    "bench": ("streamd.bench", "add_arguments", "run"),
    "cluster": ("streamd.cli.cluster", "add_arguments", "cluster_main"),
}

EXAMPLES: dict[str, str] = {
    "generate": 'streamd generate --max-tokens 32 "Once upon a time"\n'
    '  streamd generate --chat --temperature 0.7 --seed 1 "What is PagedAttention?"',
    "serve": "streamd serve --port 8000 --set cache.block_size=32\n"
    "  streamd serve --config config/streamd.toml --model /path/to/hf-model-dir\n"
    "  streamd serve Qwen/Qwen2.5-0.5B-Instruct --max-model-len 8192 --api-key KEY --served-model-name qwen",
    "chat": "streamd chat                      # the server of the config/environment (default 127.0.0.1:8000)\n"
    '  streamd chat --port 9000 --prompt "Say hi in French."',
    "bench": "streamd bench throughput --device cpu --out benchmarks/results\n  streamd bench memory --quick",
    "cluster": "streamd cluster --replicas 2 -- --set cache.num_kv_blocks=512",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamd", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, add_args, run) in COMMANDS.items():
        module = importlib.import_module(module_name)
        doc = getattr(module, run).__doc__ or module.__doc__ or name
        command = sub.add_parser(
            name,
            help=doc.strip().splitlines()[0],
            description=doc.strip(),
            epilog=f"example:\n  {EXAMPLES[name]}",
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_argument(
            "--debug", action="store_true", default=argparse.SUPPRESS, help="show the full traceback of an error"
        )
        getattr(module, add_args)(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, _, func_name = COMMANDS[args.command]
    try:
        func: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(module_name), func_name)
        return func(args) or 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        return report_error(args.command, exc)


def report_error(command: str, exc: BaseException) -> int:
    """One line on stderr naming what was wrong; the exit status (2: bad setting or argument, 1: failure)."""
    usage = isinstance(exc, ValueError)  # ConfigError, RequestError, BenchError, bad model paths...
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    prefix = "" if usage else f"{type(exc).__name__}: "
    hint = "" if usage else " (run with --debug for the traceback)"
    print(f"streamd {command}: error: {prefix}{message}{hint}", file=sys.stderr)
    return 2 if usage else 1


if __name__ == "__main__":
    sys.exit(main())
