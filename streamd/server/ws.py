"""`WS /v1/stream`: the `streamd.v1` protocol, many requests multiplexed on one socket.

One `Connection` per socket: a reader loop parses frames and starts one task per `generate`; each task
sends its own `start` / `delta` / `done` frames. Frames are written whole (uvicorn writes each message in
one call), so tasks need no send lock. When the client is slow, a task waits in `send` and its engine
deltas merge in its RequestStream meanwhile, so neither the batch nor memory suffers. Policy failures
(auth, origin, connection limit, drain) are refused before the handshake; oversize frames are closed
with 1009 by uvicorn (`ws_max_size`).
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from streamd.engine.async_engine import RequestStream
from streamd.logs import get_logger
from streamd.server import protocol
from streamd.server.errors import ServiceError
from streamd.server.generation import FINISH_REASONS, Prepared, usage

if TYPE_CHECKING:
    from streamd.server.app import Services

logger = get_logger(__name__)


class _Gone(Exception):
    """The socket is closed; nothing more can be sent."""


@dataclass(slots=True)
class _Live:
    task: asyncio.Task[None] | None = None
    stream: RequestStream | None = None
    cancel_requested: bool = False
    counted: bool = False  # its finish_reason went into streamd_requests_total


async def stream_endpoint(websocket: WebSocket) -> None:
    services: Services = websocket.app.state.services
    refusal = handshake_refusal(services, websocket)
    if refusal is not None:
        await refuse(websocket, refusal)
        return
    offered = websocket.scope.get("subprotocols", [])
    await websocket.accept(subprotocol=protocol.SUBPROTOCOL if protocol.SUBPROTOCOL in offered else None)
    conn_id = uuid.uuid4().hex[:12]
    with structlog.contextvars.bound_contextvars(conn_id=conn_id):
        await Connection(websocket, services).run()


def handshake_refusal(services: Services, websocket: WebSocket) -> ServiceError | None:
    headers = websocket.headers
    if services.lifecycle.draining:
        return ServiceError("shutting_down", "the server is shutting down")
    if not services.auth.origin_ok(headers.get("origin")):
        return ServiceError("forbidden_origin", "this Origin is not allowed")
    if not services.auth.websocket_ok(headers, websocket.scope.get("subprotocols", [])):
        return ServiceError("unauthorized", "a valid API key is required")
    if services.lifecycle.num_connections >= services.config.max_connections:
        return ServiceError("overloaded", "too many connections")
    return None


async def refuse(websocket: WebSocket, error: ServiceError) -> None:
    logger.info("ws_refused", code=error.code, origin=websocket.headers.get("origin"))
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(JSONResponse(error.openai_body(), status_code=error.status))
    else:
        await websocket.close(1008, error.code)


class Connection:
    def __init__(self, websocket: WebSocket, services: Services) -> None:
        self.ws = websocket
        self.services = services
        self.live: dict[str, _Live] = {}
        self.close_code = 1006
        self.closed = False

    async def run(self) -> None:
        metrics = self.services.metrics
        metrics.ws_connections.inc()
        logger.info("ws_open", client=_client(self.ws))
        try:
            with self.services.lifecycle.connection(self, self.close):
                await self._read()
        finally:
            self.closed = True
            tasks = [live.task for live in self.live.values() if live.task is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            metrics.ws_connections.dec()
            metrics.ws_closes.labels(str(self.close_code)).inc()
            logger.info("ws_close", code=self.close_code)

    async def close(self, code: int) -> None:
        """Closes from the server side (drain); the reader then sees the disconnect."""
        if not self.closed:
            self.closed = True
            self.close_code = code
            try:
                await self.ws.close(code)
            except (RuntimeError, OSError):
                pass

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                if not self.closed:
                    self.close_code = int(message.get("code") or 1005)
                return
            text = message.get("text")
            if text is None:
                await self._error(None, ServiceError("invalid_request", "frames must be text (JSON)"))
                continue
            await self._on_frame(text)

    async def _on_frame(self, text: str) -> None:
        try:
            frame = protocol.parse_frame(text)
        except ServiceError as exc:
            await self._error(exc.param, exc)
            return
        if isinstance(frame, protocol.Cancel):
            await self._cancel(frame.id)
            return
        try:
            prepared = self._admit(frame)
        except ServiceError as exc:
            await self._error(frame.id, exc)
            return
        live = self.live[frame.id] = _Live()
        live.task = asyncio.create_task(self._serve(frame.id, prepared, live))

    def _admit(self, frame: protocol.Generate) -> Prepared:
        """Checks and tokenizes a generate frame; raises ServiceError."""
        if frame.id in self.live:
            raise ServiceError("duplicate_id", f"id {frame.id!r} is already in flight")
        if len(self.live) >= self.services.config.max_requests_per_connection:
            raise ServiceError("too_many_requests", "too many requests in flight on this connection "
                               f"(limit {self.services.config.max_requests_per_connection})")
        if self.services.lifecycle.draining:
            raise ServiceError("shutting_down", "the server is shutting down")
        gen = self.services.generation
        if frame.messages is not None:
            ids, prompt = gen.messages_ids(frame.messages), None
        else:
            ids, prompt = gen.prompt_ids(frame.prompt), frame.prompt if isinstance(frame.prompt, str) else None
        return gen.prepare(ids, frame.params, default_max_tokens=None, prompt=prompt)

    async def _cancel(self, client_id: str) -> None:
        live = self.live.get(client_id)
        if live is None:
            await self._error(client_id, ServiceError("unknown_id", f"no request {client_id!r} in flight"))
            return
        live.cancel_requested = True
        if live.stream is not None:
            live.stream.cancel()

    async def _serve(self, client_id: str, prepared: Prepared, live: _Live) -> None:
        with structlog.contextvars.bound_contextvars(request_id=client_id):
            try:
                await self._generate(client_id, prepared, live)
            except _Gone:
                pass
            finally:
                if live.stream is not None and not live.stream.finished:
                    live.stream.cancel()  # the client vanished or the task was cancelled: free the blocks
                if live.stream is not None and not live.counted:
                    self.services.generation.finished("cancelled")
                self.live.pop(client_id, None)

    async def _generate(self, client_id: str, prepared: Prepared, live: _Live) -> None:
        gen = self.services.generation
        try:
            stream = await gen.submit(prepared)
        except ServiceError as exc:
            await self._error(client_id, exc)
            return
        live.stream = stream
        if live.cancel_requested:
            stream.cancel()
        with self.services.lifecycle.track(stream):
            await self._send(protocol.start_frame(client_id, len(prepared.prompt_token_ids)))
            seq, completion, reason, error, cached = 0, 0, None, None, 0
            async for delta in stream:
                for choice in delta.outputs:
                    if choice.text or choice.token_ids:
                        await self._send(protocol.delta_frame(client_id, seq, choice.text, choice.token_ids,
                                                              choice.index, choice.logprobs))
                        seq += 1
                    completion = choice.num_tokens or completion
                    reason = choice.finish_reason or reason
                error, cached = delta.error or error, delta.num_cached_tokens
            finish = "error" if error else FINISH_REASONS.get(reason or "abort", "cancelled")
            if error:
                await self._error(client_id, ServiceError("internal_error", error))
            gen.finished(finish)
            live.counted = True
            logger.info("request_done", finish_reason=finish, prompt_tokens=len(prepared.prompt_token_ids),
                        completion_tokens=completion)
            await self._send(protocol.done_frame(client_id, finish,
                                                 usage(len(prepared.prompt_token_ids), completion, cached)))

    async def _error(self, client_id: str | None, error: ServiceError) -> None:
        try:
            await self._send(protocol.error_frame(client_id, error))
        except _Gone:
            pass

    async def _send(self, text: str) -> None:
        if self.closed:
            raise _Gone
        try:
            await self.ws.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise _Gone from exc


def _client(websocket: WebSocket) -> Any:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else None
