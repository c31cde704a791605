"""Serve the model over HTTP and WebSocket (`streamd serve`), or chat with a server (`streamd chat`).

Top-level imports stay light so `streamd --help` is instant; the server stack loads when a command runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model directory, Hub id already in the local cache, or GGUF file "
                        "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--host", help="address to listen on (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default from config: 8000; 0 picks one)")
    parser.add_argument("--config", help="a streamd.toml file")
    parser.add_argument("--tp", type=int, help="tensor parallel size: ranks (processes) the model is split over "
                        "(default from config: 1)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any config key, e.g. --set server.api_keys=k1,k2 (repeatable)")


def serve_main(args: argparse.Namespace) -> int:
    """Serve the model over HTTP (OpenAI-compatible) and WebSocket."""
    from streamd.config import load_config
    from streamd.server.serve import configure_server_logging, run_server

    overrides: dict[str, Any] = dict(_parse_set(item) for item in args.set)
    for key, value in (("model.name", args.model), ("server.host", args.host), ("server.port", args.port),
                       ("parallel.tensor_parallel_size", args.tp)):
        if value is not None:
            overrides[key] = value
    config = load_config(args.config, overrides)
    configure_server_logging(config)
    return run_server(config)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="ws://127.0.0.1:8000/v1/stream", help="the server's WebSocket URL")
    parser.add_argument("--api-key", help="API key (or STREAMD_API_KEY)")
    parser.add_argument("--system", help="a system message")
    parser.add_argument("--prompt", help="send one message, print the answer and exit")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)


def chat_main(args: argparse.Namespace) -> int:
    """Chat with a running server from the terminal, over the WebSocket."""
    from streamd.server.chat_client import run_chat

    return run_chat(args)


def _parse_set(item: str) -> tuple[str, Any]:
    from streamd.config import parse_value

    key, sep, raw = item.partition("=")
    if not sep:
        raise SystemExit(f"--set expects KEY=VALUE, got {item!r}")
    return key.strip(), parse_value(raw)
