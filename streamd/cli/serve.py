"""`streamd serve`: the command line of the server (its arguments, the configuration they give, a port
check before the model loads). The server itself (`run_server`) is `streamd.server.serve`'s; its stack
loads only when the command runs, so `streamd --help` stays light.

Its flags are vLLM's (`streamd serve MODEL --max-model-len 8192 -tp 2 --api-key K --served-model-name a b`),
generated from the config's keys (`streamd.cli.settings`): a `vllm serve` line starts streamd.
"""

from __future__ import annotations

import argparse
import socket

from streamd.cli.settings import add_config_arguments, add_config_flags, load_settings
from streamd.config import SECTIONS, ConfigError


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "%(prog)s [MODEL] [--FLAG VALUE ...]  (every flag: --help)"
    parser.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="model directory, Hub id already in the local cache, or GGUF file (default: SmolLM2-135M-Instruct); "
        "the same as --model",
    )
    add_config_arguments(parser)
    add_config_flags(parser, SECTIONS)


def serve_main(args: argparse.Namespace) -> int:
    """Serve the model over HTTP (OpenAI-compatible) and WebSocket."""
    from streamd.server.serve import configure_server_logging, run_server

    config = load_settings(args, {"model.name": positional_model(args)})
    check_port_free(config.server.host, config.server.port)  # before the model loads, not after
    configure_server_logging(config)
    return run_server(config)


def positional_model(args: argparse.Namespace) -> str | None:
    """The MODEL argument (vLLM's `model_tag`); refused when --model names another."""
    flag = getattr(args, "model.name")
    if args.model_tag is not None and flag is not None and flag != args.model_tag:
        raise ConfigError(f"two models given: {args.model_tag!r} and --model {flag!r}")
    return args.model_tag


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
