"""`WS /v1/stream`: many requests multiplexed on one socket, in `streamd.v1` or `streamd.v2` framing.

One `Connection` per socket: a reader loop parses frames and starts an admission task per `generate`;
each admitted request is a `WsRequest`, the `DeltaSink` its engine deltas go to. One writer task per
connection sends everything: when it wakes it takes every request that has something new (typically one
engine step's deltas of all of them), builds their `start` / `delta` / `done` / `error` frames and writes
them, as one message in v2 or one message per frame in v1. While the client is slow the writer waits in
`send` and new deltas merge into each request's pending delta, so neither the batch nor memory suffers.
Policy failures (auth, origin, connection limit, drain) are refused before the handshake; oversize frames
are closed with 1009 by uvicorn (`ws_max_size`). A connection that sends `subscribe_stats` also gets the
live engine view (`stats` frames, stats_feed.py); only the newest unsent one is kept, so a slow reader
never queues them up.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import structlog
from starlette.responses import JSONResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from streamd.engine.outputs import RequestDelta
from streamd.logs import get_logger
from streamd.server import protocol
from streamd.server.accounting import RequestAccount
from streamd.server.errors import ServiceError
from streamd.server.generation import Prepared
from streamd.server.services import Services
from streamd.server.stats_feed import StatsFeed

logger = get_logger(__name__)


async def stream_endpoint(websocket: WebSocket) -> None:
    services: Services = websocket.app.state.services
    refusal = handshake_refusal(services, websocket)
    if refusal is not None:
        await refuse(websocket, refusal)
        return
    offered = websocket.scope.get("subprotocols", [])
    chosen = next((p for p in protocol.SUBPROTOCOLS if p in offered), None)
    await websocket.accept(subprotocol=chosen)
    conn_id = uuid.uuid4().hex[:12]
    with structlog.contextvars.bound_contextvars(conn_id=conn_id):
        await Connection(websocket, services, batched=chosen == protocol.SUBPROTOCOL_V2).run()


def handshake_refusal(services: Services, websocket: WebSocket) -> ServiceError | None:
    headers = websocket.headers
    if services.lifecycle.draining:
        return ServiceError("shutting_down", "the server is shutting down")
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
        await websocket.send_denial_response(JSONResponse(error.openai_body(), status_code=error.status))
    else:
        await websocket.close(1008, error.code)


class WsRequest:
    """One request in flight on a connection: its admission, its pending delta, its frame sequence."""

    __slots__ = ("client_id", "prepared", "connection", "account", "task", "pending", "seq", "start_sent",
                 "cancel_requested", "finished")

    def __init__(self, client_id: str, connection: Connection) -> None:
        self.client_id = client_id
        self.prepared: Prepared | None = None  # set once tokenized and checked
        self.connection = connection
        self.account: RequestAccount | None = None  # set once admitted
        self.task: asyncio.Task[None] | None = None
        self.pending: RequestDelta | None = None
        self.seq = 0
        self.start_sent = False
        self.cancel_requested = False
        self.finished = False  # its done frame is built (the account closes once it is sent)

    def put(self, delta: RequestDelta) -> None:
        """DeltaSink: merge, and tell the writer."""
        if self.pending is None:
            self.pending = delta
        else:
            self.pending.merge(delta)
        self.connection.wake(self)

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.account is not None:
            self.account.cancel()

    def frames(self) -> list[protocol.Frame]:
        """What this request has to send now (nothing before it is admitted)."""
        account, prepared = self.account, self.prepared
        if account is None or prepared is None:
            return []
        frames = []
        if not self.start_sent:
            frames.append(protocol.start_frame(self.client_id, len(prepared.prompt_token_ids)))
            self.start_sent = True
        delta, self.pending = self.pending, None
        if delta is None:
            return frames
        account.absorb(delta)
        for choice in delta.outputs:
            if choice.text or choice.token_ids:
                frames.append(protocol.delta_frame(self.client_id, self.seq, choice.text, choice.token_ids,
                                                   choice.index, choice.logprobs))
                self.seq += 1
        if delta.finished:
            if delta.error is not None:
                frames.append(protocol.error_frame(self.client_id, ServiceError("internal_error", delta.error)))
            frames.append(protocol.done_frame(self.client_id, account.finish.wire, account.usage(),
                                              [finish.wire for finish in account.choice_finishes()]))
            self.finished = True
            self.connection.forget(self)
        return frames


class Connection:
    def __init__(self, websocket: WebSocket, services: Services, batched: bool) -> None:
        self.ws = websocket
        self.services = services
        self.batched = batched
        self.live: dict[str, WsRequest] = {}
        self.close_code = 1006
        self.closed = False
        self._ready: dict[WsRequest, None] = {}  # requests with something to send, in order
        self._control: list[protocol.Frame] = []  # error frames not tied to a live request
        self._stats: protocol.Frame | None = None  # the newest unsent stats frame
        self.stats_feed = StatsFeed(services.engine, self.push_stats)
        self._wake = asyncio.Event()

    async def run(self) -> None:
        metrics = self.services.metrics
        metrics.ws_connections.inc()
        logger.info("ws_open", client=_client(self.ws), batched=self.batched)
        writer = asyncio.create_task(self._write_loop())
        try:
            with self.services.lifecycle.connection(self, self.close):
                await self._read()
        finally:
            self.closed = True
            self.stats_feed.stop()
            writer.cancel()
            await self._let_go()
            await asyncio.gather(writer, return_exceptions=True)
            metrics.ws_connections.dec()
            metrics.ws_closes.labels(str(self.close_code)).inc()
            logger.info("ws_close", code=self.close_code)

    async def _let_go(self) -> None:
        """The socket is gone: cancel admissions, abort what runs (accounts close on the final deltas)."""
        tasks = [r.task for r in self.live.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for request in list(self.live.values()):
            request.cancel()

    async def close(self, code: int) -> None:
        """Closes from the server side (drain); the reader then sees the disconnect."""
        if not self.closed:
            self.closed = True
            self.close_code = code
            try:
                await self.ws.close(code)
            except (RuntimeError, OSError):
                pass

    # ---- writing -----------------------------------------------------------------------------------
    def wake(self, request: WsRequest) -> None:
        if self.closed:
            self._drop_unsent(request)
            return
        self._ready[request] = None
        self._wake.set()

    def forget(self, request: WsRequest) -> None:
        self.live.pop(request.client_id, None)

    def _drop_unsent(self, request: WsRequest) -> None:
        """After the socket closed: nothing is sent, but the account still takes the deltas."""
        delta, request.pending = request.pending, None
        if delta is not None and request.account is not None:
            request.account.absorb(delta)
            if delta.finished:
                request.account.close()
                self.forget(request)

    def send_error(self, client_id: str | None, error: ServiceError) -> None:
        if not self.closed:
            self._control.append(protocol.error_frame(client_id, error))
            self._wake.set()

    def push_stats(self, frame: protocol.Frame) -> None:
        """Replaces any stats frame not yet written (the view wants the newest, not every one)."""
        if not self.closed:
            self._stats = frame
            self._wake.set()

    async def _write_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            frames, self._control = self._control, []
            ready, self._ready = self._ready, {}
            for request in ready:
                frames.extend(request.frames())
            if self._stats is not None:
                frames.append(self._stats)
                self._stats = None
            try:
                for message in protocol.encode(frames, self.batched):
                    await self.ws.send_text(message)
            except (WebSocketDisconnect, RuntimeError, OSError):
                self.closed = True
            finally:  # a request is counted (and leaves the drain's view) once its done frame went out
                for request in ready:
                    if request.finished and request.account is not None:
                        request.account.close()
            if self.closed:
                return

    # ---- reading -----------------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                if not self.closed:
                    self.close_code = int(message.get("code") or 1005)
                return
            text = message.get("text")
            if text is None:
                self.send_error(None, ServiceError("invalid_request", "frames must be text (JSON)"))
                continue
            self._on_frame(text)

    def _on_frame(self, text: str) -> None:
        try:
            frame = protocol.parse_frame(text)
        except ServiceError as exc:
            self.send_error(exc.param, exc)
            return
        if isinstance(frame, protocol.SubscribeStats):
            self.stats_feed.subscribe(frame.interval_s)
            return
        if isinstance(frame, protocol.UnsubscribeStats):
            self.stats_feed.stop()
            self._stats = None  # nothing of the feed goes out after this frame
            return
        if isinstance(frame, protocol.Cancel):
            self._cancel(frame.id)
            return
        try:
            self._check_room(frame.id)
        except ServiceError as exc:
            self.send_error(frame.id, exc)
            return
        request = self.live[frame.id] = WsRequest(frame.id, self)
        request.task = asyncio.create_task(self._admit(request, frame))

    def _check_room(self, client_id: str) -> None:
        """Raises ServiceError if this connection cannot take another request now."""
        if client_id in self.live:
            raise ServiceError("duplicate_id", f"id {client_id!r} is already in flight")
        if len(self.live) >= self.services.config.max_requests_per_connection:
            raise ServiceError("too_many_requests", "too many requests in flight on this connection "
                               f"(limit {self.services.config.max_requests_per_connection})")
        if self.services.lifecycle.draining:
            raise ServiceError("shutting_down", "the server is shutting down")

    async def _prepare(self, frame: protocol.Generate) -> Prepared:
        """Tokenizes (off the loop when long) and checks a generate frame; raises ServiceError."""
        gen = self.services.generation
        if frame.messages is not None:
            ids, prompt, param = await gen.messages_ids(frame.messages), None, "messages"
        else:
            ids = await gen.prompt_ids(frame.prompt)
            prompt, param = (frame.prompt if isinstance(frame.prompt, str) else None), "prompt"
        return gen.prepare(ids, frame.params, default_max_tokens=self.services.config.default_max_tokens,
                           prompt=prompt, prompt_param=param)

    def _cancel(self, client_id: str) -> None:
        request = self.live.get(client_id)
        if request is None:
            self.send_error(client_id, ServiceError("unknown_id", f"no request {client_id!r} in flight"))
            return
        request.cancel()

    async def _admit(self, request: WsRequest, frame: protocol.Generate) -> None:
        gen = self.services.generation
        try:
            try:
                request.prepared = await self._prepare(frame)
            except asyncio.CancelledError:
                gen.count_cancelled("ws")  # the socket went away while it was tokenized
                raise
            account, _ = await gen.submit(request.prepared, "ws", sink=request)
        except ServiceError as exc:
            self.forget(request)
            self.send_error(request.client_id, exc)
            return
        except Exception:  # a bug must not leave the id without an answer (or its slot taken)
            logger.exception("ws_admission_failed", id=request.client_id)
            self.forget(request)
            self.send_error(request.client_id, ServiceError("internal_error", "the request could not be started"))
            return
        request.account = account
        if request.cancel_requested:
            account.cancel()
        self.wake(request)


def _client(websocket: WebSocket) -> Any:
    client = websocket.client
    return f"{client.host}:{client.port}" if client else None
