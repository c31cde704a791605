"""`streamd serve`: the command line of the server (its arguments, the configuration they give, a port
check before the model loads). The server itself (`run_server`) is `streamd.server.serve`'s; its stack
loads only when the command runs, so `streamd --help` stays light.
"""

from __future__ import annotations

import argparse
import socket

from streamd.cli.settings import add_config_arguments, load_settings
from streamd.config import ConfigError


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
    add_config_arguments(parser)


def serve_main(args: argparse.Namespace) -> int:
    """Serve the model over HTTP (OpenAI-compatible) and WebSocket."""
    from streamd.server.serve import configure_server_logging, run_server

    config = load_settings(
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
    """Raises ConfigError naming the address when nothing could listen on it (busy, or not this host's):
    a bad --host/--port is a usage error found at once, not after the model loaded."""
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
