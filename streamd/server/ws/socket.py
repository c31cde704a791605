"""What the two WebSocket endpoints (`/v1/stream`, ws.py; `/v1/responses`, responses_ws.py) share.

- The handshake policy (drain, Origin, API key, connection limit), applied before the socket is accepted:
  `accept` refuses with a denial response (or a 1008 close) and returns None, or accepts.
- `SocketConnection`, one accepted socket's life: the open/close metrics and log lines, the registration
  for the drain (which closes it with 1012, "service restart", that clients reconnect after), the
  server-side close and the reader loop. A subclass writes (`_write_loop`), handles each message
  (`_on_message`: its text, None for a binary message) and lets go of its requests once the socket is gone
  (`_let_go`).
- The caller's key (`api_key`, `Authenticator.websocket_key`: the key that authenticated the handshake),
  the one binding of a connection's resumable requests and stored responses.
- The bound on replies a client leaves unread: replies to what the client sends (error frames/events) are
  queued without waiting, so a client that sends without reading could grow them without end. Past
  `server.max_queued_frames` unsent (`check_backlog`) the socket is closed with 1008; the close itself is
  bounded (handshake.py aborts a close that cannot be written or is not answered).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import structlog
from starlette.websockets import WebSocket

from streamd.logs import get_logger
from streamd.server.errors import ServiceError, error_response
from streamd.server.services import Services

logger = get_logger(__name__)
DRAIN_CLOSE_CODE = 1012  # "service restart": clients (the OpenAI SDK among them) reconnect


async def accept(websocket: WebSocket, subprotocol: str | None = None) -> Services | None:
    """Accepts the socket (with `subprotocol`) and returns the app's services, or refuses it (None)."""
    services: Services = websocket.app.state.services
    refusal = handshake_refusal(services, websocket)
    if refusal is not None:
        await refuse(websocket, refusal)
        return None
    await websocket.accept(subprotocol=subprotocol)
    return services


def handshake_refusal(services: Services, websocket: WebSocket) -> ServiceError | None:
    headers = websocket.headers
    if services.lifecycle.draining:
        return ServiceError("shutting_down", "the server is shutting down")
    if (refusal := services.auth.host_refusal(headers.get("host"))) is not None:
        return refusal
    if not services.auth.origin_ok(headers.get("origin"), headers.get("host")):
        return ServiceError("forbidden_origin", "this Origin is not allowed")
    if not services.auth.websocket_ok(headers, websocket.scope.get("subprotocols", [])):
        return ServiceError("unauthorized", "a valid API key is required")
    if services.lifecycle.num_connections >= services.config.max_connections:
        return ServiceError("overloaded", "too many connections")
    return None


async def refuse(websocket: WebSocket, error: ServiceError) -> None:
    logger.info("ws_refused", code=error.code, origin=websocket.headers.get("origin"))
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error_response(error))
    else:
        await websocket.close(1008, error.code)


class SocketConnection:
    """An accepted socket: `run` reads it until it closes, then lets go of everything."""

    log_name = "ws"  # the open/close log events are `{log_name}_open` / `{log_name}_close`

    def __init__(self, websocket: WebSocket, services: Services) -> None:
        self.ws = websocket
        self.services = services
        self.api_key = services.auth.websocket_key(websocket.headers, websocket.scope.get("subprotocols", []))
        self.close_code = 1006
        self.closed = False
        self._closing: asyncio.Task[None] | None = None  # a close this connection chose (1008)

    async def run(self) -> None:
        metrics = self.services.metrics
        metrics.ws_connections.inc()
        with structlog.contextvars.bound_contextvars(conn_id=uuid.uuid4().hex[:12]):
            logger.info(f"{self.log_name}_open", client=_client(self.ws), **self._describe())
            writer = asyncio.create_task(self._write_loop())
            try:
                with self.services.lifecycle.connection(self, self.close, DRAIN_CLOSE_CODE):
                    await self._read()
            finally:
                self.closed = True
                writer.cancel()
                await self._let_go()
                await asyncio.gather(writer, *([self._closing] if self._closing else []), return_exceptions=True)
                metrics.ws_connections.dec()
                metrics.ws_closes.labels(str(self.close_code)).inc()
                logger.info(f"{self.log_name}_close", code=self.close_code)

    async def close(self, code: int) -> None:
        """Closes from the server side (drain); the reader then sees the disconnect."""
        if not self.closed:
            self.closed = True
            self.close_code = code
            await self._send_close(code)

    async def _send_close(self, code: int, reason: str = "") -> None:
        try:
            await self.ws.close(code, reason)
        except (RuntimeError, OSError):
            pass

    def check_backlog(self, queued: int) -> None:
        """Closes the socket (1008) when `queued` unsent replies pass `server.max_queued_frames`: its
        client sends without reading what it is answered."""
        limit = self.services.config.max_queued_frames
        if queued <= limit or self.closed:
            return
        logger.warning("ws_replies_unread", queued=queued, limit=limit)
        self.closed = True
        self.close_code = 1008
        reason = f"over {limit} replies unread (server.max_queued_frames)"
        self._closing = asyncio.create_task(self._send_close(1008, reason))

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                if not self.closed:
                    self.close_code = int(message.get("code") or 1005)
                return
            self._on_message(message.get("text"))
            await asyncio.sleep(0)  # the writer's turn: replies to a burst of messages go out as they come

    # ---- what a subclass provides --------------------------------------------------------------------
    def _describe(self) -> dict[str, Any]:
        """Extra fields of the open log line."""
        return {}

    async def _write_loop(self) -> None:
        raise NotImplementedError

    def _on_message(self, text: str | None) -> None:
        raise NotImplementedError

    async def _let_go(self) -> None:
        raise NotImplementedError


def _client(websocket: WebSocket) -> Any:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else None
