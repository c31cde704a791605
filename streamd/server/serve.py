"""Running the app under uvicorn (one process, uvloop) with a graceful drain on SIGTERM.

uvicorn's own shutdown would close WebSockets with 1012 at once and re-raise the signal (exit code
-15). `DrainingServer` intercepts the first SIGTERM/SIGINT instead: the app drains (see lifecycle.py),
then uvicorn shuts down normally and the process exits 0. A second signal forces the exit.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import Callable, Coroutine
from dataclasses import asdict
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
import uvicorn
from starlette.applications import Starlette

from streamd.config import Config
from streamd.engine import AsyncEngine, EngineClient
from streamd.logs import get_logger
from streamd.server.app import create_app
from streamd.server.connections import ConnectionGate, ConnectionLimits, gated_protocols, open_file_limit
from streamd.server.lifecycle import Lifecycle

if TYPE_CHECKING:
    from streamd.engine import LLMEngine

logger = get_logger(__name__)
T = TypeVar("T")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, send_buffer_bytes: int = 0) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.send_buffer_bytes = send_buffer_bytes  # server.socket_send_buffer_bytes (0: the OS's autotuning)
        self._drain_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None  # the bound port (useful with port 0)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if sockets is None and self.send_buffer_bytes:
            sockets = [_listening_socket(self.config.host, self.config.port, self.send_buffer_bytes)]
        await super().startup(sockets)
        ports = [s.getsockname()[1] for server in self.servers for s in server.sockets]
        self.port = ports[0] if ports else self.config.port
        logger.info("listening", host=self.config.host, port=self.port)
        self.listening.set()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_task is not None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # second signal, or before startup: uvicorn's behaviour
            return
        logger.info("signal_received", signal=signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        try:
            await self.lifecycle.drain()
        finally:
            self.should_exit = True


def _listening_socket(host: str, port: int, send_buffer_bytes: int) -> socket.socket:
    """A bound socket whose accepted connections inherit a fixed send buffer: a reader that stops
    reading then fills it (and the transport's buffer) soon, so its requests pause (max_unsent_tokens)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    sock.bind((host, port))
    return sock


def uvicorn_config(config: Config, app: Starlette) -> uvicorn.Config:
    """uvicorn's settings; every socket's protocol is gated by the connection limits (connections.py)."""
    limits = ConnectionLimits.of(config.server, open_file_limit())
    logger.info("connection_limits", **asdict(limits))
    http_protocol, ws_protocol = gated_protocols(ConnectionGate(limits), config.server.ws_close_timeout_s)
    return uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        loop="none",
        lifespan="on",
        # httptools (C) parses requests and frames each SSE chunk with one transport write; h11 (pure
        # Python) cost several times more event-loop time per streamed chunk.
        http=http_protocol,
        ws=ws_protocol,
        timeout_keep_alive=config.server.keep_alive_timeout_s,
        ws_max_size=config.server.max_frame_bytes,
        ws_per_message_deflate=False,  # token frames are tiny; deflate costs more CPU than it saves
        ws_ping_interval=config.server.ws_ping_interval_s or None,  # None: uvicorn pings never
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )


def engine_in_own_process(config: Config) -> bool:
    """`engine.process` decided: "auto" is on without tensor parallelism (one GPU, or the CPU)."""
    if isinstance(config.engine.process, bool):
        return config.engine.process
    return config.parallel.tensor_parallel_size == 1


def engine_for(config: Config, factory: Callable[..., LLMEngine], *args: Any) -> EngineClient:
    """The engine `factory(*args)` builds, on a thread of this process or in its own process (outputs made
    here) as `engine.process` decides."""
    if engine_in_own_process(config):
        from streamd.engine import ProcessEngine

        return ProcessEngine(factory, *args, outputs="network", batches_ahead=config.engine.batches_ahead)
    return AsyncEngine(factory(*args))


def http_server(config: Config, engine: EngineClient) -> DrainingServer:
    """The app over `engine`, in the uvicorn server `streamd serve` runs."""
    app = create_app(config, engine)
    return DrainingServer(
        uvicorn_config(config, app), app.state.services.lifecycle, config.server.socket_send_buffer_bytes
    )


async def serve(config: Config) -> int:
    from streamd.engine import LLMEngine

    logger.info("loading_model", model=config.model.name or "default", engine_process=engine_in_own_process(config))
    engine = engine_for(config, LLMEngine.from_config, config)
    server = http_server(config, engine)
    try:
        await server.serve()
    finally:
        await engine.shutdown()
    logger.info("stopped")
    return 0 if server.started else 1


def configure_server_logging(config: Config) -> None:
    """The project's structlog setup, plus uvicorn's standard-library logs in the same format."""
    import logging
    import os
    import sys

    from streamd.logs import configure_logging

    level, fmt = config.logging.level, os.environ.get("STREAMD_LOG_FORMAT", config.logging.format).lower()
    configure_logging(level, fmt)
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            renderer,
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def run_server(config: Config) -> int:
    return run_on_uvloop(serve(config))


def run_on_uvloop(main: Coroutine[Any, Any, T]) -> T:
    """Runs a coroutine on uvloop (the server's loop, and the bench clients') when it is installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.run(main)
    return uvloop.run(main)
