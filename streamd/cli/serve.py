"""Serve the model over HTTP and WebSocket (`streamd serve`), or chat with a server (`streamd chat`).

Both read the same configuration (defaults < `--config` file < `STREAMD_<SECTION>__<KEY>` < flags), so
`streamd chat` finds the server `streamd serve` started with the same settings. Top-level imports stay
light so `streamd --help` is instant; the server stack loads when a command runs.
"""

from __future__ import annotations

import argparse
import socket
from typing import Any

from streamd.config import Config, ConfigError


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="model directory, Hub id already in the local cache, or GGUF file (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--host", help="address to listen on (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default from config: 8000; 0 picks one)")
    parser.add_argument(
        "--tp",
        type=int,
        help="tensor parallel size: ranks (processes) the model is split over (default from config: 1)",
    )
    _add_config_arguments(parser)


def serve_main(args: argparse.Namespace) -> int:
    """Serve the model over HTTP (OpenAI-compatible) and WebSocket."""
    from streamd.server.serve import configure_server_logging, run_server

    config = _load(
        args,
        {
            "model.name": args.model,
            "server.host": args.host,
            "server.port": args.port,
            "parallel.tensor_parallel_size": args.tp,
        },
    )
    check_port_free(config.server.host, config.server.port)  # before the model loads, not after
    configure_server_logging(config)
    return run_server(config)


def check_port_free(host: str, port: int) -> None:
    """Raises ConfigError naming the address when nothing could listen on it (busy, or not this host's)."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"server.host {host!r} does not resolve: {exc.strerror}") from exc
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is no conflict
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port} (server.host/server.port): {exc.strerror}") from exc


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        help="the server's WebSocket URL (default: ws://HOST:PORT/v1/stream from the "
        "config, environment and --host/--port, as `streamd serve` reads them)",
    )
    parser.add_argument("--host", help="the server's address (default from config: 127.0.0.1)")
    parser.add_argument("--port", type=int, help="the server's port (default from config: 8000)")
    parser.add_argument(
        "--api-key", help="API key (default: STREAMD_API_KEY, else the config's first server.api_keys entry)"
    )
    parser.add_argument("--system", help="a system message")
    parser.add_argument("--prompt", help="send one message, print the answer and exit")
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.7)
    _add_config_arguments(parser)


def chat_main(args: argparse.Namespace) -> int:
    """Chat with a running server from the terminal, over the WebSocket."""
    import os

    from streamd.cli.chat import run_chat

    config = _load(args, {"server.host": args.host, "server.port": args.port})
    if config.server.port == 0:
        raise ConfigError("server.port is 0 (the server picked one): give --port or --url")
    args.url = args.url or chat_url(config)
    keys = config.server.api_keys
    args.api_key = args.api_key or os.environ.get("STREAMD_API_KEY") or (keys[0] if keys else None)
    return run_chat(args)


def chat_url(config: Config) -> str:
    host = config.server.host
    if host in ("0.0.0.0", "::", ""):  # listening everywhere: this machine answers on loopback
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"ws://{host}:{config.server.port}/v1/stream"


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="a streamd.toml file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set server.api_keys=k1,k2 (repeatable)",
    )


def _load(args: argparse.Namespace, flags: dict[str, Any]) -> Config:
    from streamd.config import load_config

    overrides: dict[str, Any] = dict(_parse_set(item) for item in args.set)
    overrides.update({key: value for key, value in flags.items() if value is not None})
    return load_config(args.config, overrides)


def _parse_set(item: str) -> tuple[str, Any]:
    from streamd.config import parse_value

    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
    return key.strip(), parse_value(raw)
