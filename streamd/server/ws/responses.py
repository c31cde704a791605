"""`WS /v1/responses`: the Responses API's WebSocket mode, as the OpenAI SDK's
`client.beta.responses.connect()` speaks it.

Client events: `response.create` (the fields of `POST /v1/responses`, plus the WebSocket-only `stream_id`
lane: responses on one lane run FIFO, different lanes run concurrently) and `response.cancel`
(`response_id`, or `stream_id` for that lane's current response; the SDK has no cancel event of its own,
so this is the Realtime API's name). Server events are those of SSE (`streamd.server.responses.ResponseBuilder`), each
echoing its `stream_id`; a refused event gets an `error` event and the socket stays open.
`previous_response_id` finds responses of this connection (even with `store: false`) and then the
server's store under the connection's key (the one that authenticated the handshake, header or
`bearer.` subprotocol: `SocketConnection.api_key`). A `stream_id` is an id like `/v1/stream`'s (at most
256 characters: it is echoed in every event); a lane is remembered only while a response of it is
queued or running.

Writing: error events are queued at once (bounded by `server.max_queued_frames`, then 1008: socket.py);
a response's events wait while `EVENTS_AHEAD` events are unsent, so a client that stops reading stops
its responses' tasks from taking their deltas, and the stream's `Backpressure` pauses them in the engine
past `server.max_unsent_tokens` (as on `/v1/stream`). Handshake policy (auth, Origin, connection limit,
drain), the reader loop and the drain's close are ws_socket.py's: a drain closes the socket with 1012
once its responses finish, which the SDK's reconnect logic treats as recoverable.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from streamd.logs import get_logger
from streamd.server.encoding import dumps, loads_object
from streamd.server.errors import ServiceError
from streamd.server.responses import ResponsePlan, ResponseRun, builder_for, keep, plan_response
from streamd.server.responses_store import StoredResponse
from streamd.server.services import Services
from streamd.server.ws.protocol import check_id
from streamd.server.ws.socket import SocketConnection, accept

logger = get_logger(__name__)
EVENTS_AHEAD = 8  # a response's events (each a merged delta) unsent before its task waits for the writer


async def responses_endpoint(websocket: WebSocket) -> None:
    services = await accept(websocket)
    if services is not None:
        await ResponsesConnection(websocket, services).run()


class ResponsesConnection(SocketConnection):
    log_name = "responses_ws"

    def __init__(self, websocket: WebSocket, services: Services) -> None:
        super().__init__(websocket, services)
        self.key = self.api_key or ""  # the response store's partition
        self.tasks: set[asyncio.Task[None]] = set()
        self.lanes: dict[str | None, asyncio.Task[None]] = {}  # each busy lane's latest response task
        self.running: dict[str, ResponseRun] = {}  # response id -> its run, while it runs
        self.recent: OrderedDict[str, StoredResponse] = OrderedDict()  # this connection's finished responses
        self.outbox: deque[dict[str, Any]] = deque()  # events not yet written
        self._wake = asyncio.Event()  # the outbox has something
        self._room = asyncio.Event()  # the outbox is under EVENTS_AHEAD
        self._room.set()

    async def _let_go(self) -> None:
        """The socket is gone: cancel every response (each closes its account)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    # ---- writing -----------------------------------------------------------------------------------
    def _push(self, event: dict[str, Any]) -> None:
        if not self.closed:
            self.outbox.append(event)
            self._wake.set()

    async def emit_in_turn(self, event: dict[str, Any]) -> None:
        """A response's event: waits while EVENTS_AHEAD are unsent (a slow reader holds its responses up)."""
        while len(self.outbox) >= EVENTS_AHEAD and not self.closed:
            self._room.clear()
            await self._room.wait()
        self._push(event)

    def emit_error(self, error: ServiceError, stream_id: str | None) -> None:
        """A refusal, queued at once (the reader never waits); too many unread closes the socket."""
        event: dict[str, Any] = {"type": "error", "status": error.status, **error.openai_body()}
        if stream_id is not None:
            event["stream_id"] = stream_id
        self._push(event)
        self.check_backlog(len(self.outbox))

    async def _write_loop(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self.outbox:
                    event = self.outbox.popleft()
                    if len(self.outbox) < EVENTS_AHEAD:
                        self._room.set()
                    await self.ws.send_text(dumps(event))
        except (WebSocketDisconnect, RuntimeError, OSError):
            self.closed = True
        finally:
            self._room.set()  # nothing waits for a writer that is gone

    # ---- reading -----------------------------------------------------------------------------------
    def _on_message(self, text: str | None) -> None:
        try:
            self._on_event(_parse(text))
        except ServiceError as exc:
            self.emit_error(exc, None)

    def _on_event(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "response.cancel":
            self._cancel(event)
            return
        if kind != "response.create":
            raise ServiceError(
                "unknown_type", f"unknown event type {kind!r} (expected response.create or response.cancel)", "type"
            )
        stream_id = event.get("stream_id")
        try:
            self._check_room(stream_id)
        except ServiceError as exc:
            self.emit_error(exc, stream_id if exc.param != "stream_id" else None)
            return
        body = {k: v for k, v in event.items() if k not in ("type", "stream_id", "stream", "event_id")}
        task = asyncio.create_task(self._respond(body, stream_id, self.lanes.get(stream_id)))
        self.lanes[stream_id] = task
        self.tasks.add(task)
        task.add_done_callback(lambda done: self._task_done(stream_id, done))

    def _task_done(self, stream_id: str | None, task: asyncio.Task[None]) -> None:
        """A response task ended: its lane is forgotten unless a later response of it is queued."""
        self.tasks.discard(task)
        if self.lanes.get(stream_id) is task:
            del self.lanes[stream_id]

    def _check_room(self, stream_id: Any) -> None:
        """Raises ServiceError if this connection cannot take another response now."""
        if stream_id is not None:
            check_id(stream_id, "stream_id", "stream_id")
        limit = self.services.config.max_requests_per_connection
        if len(self.tasks) >= limit:
            raise ServiceError("too_many_requests", f"too many responses in flight on this connection (limit {limit})")
        if self.services.lifecycle.draining:
            raise ServiceError("shutting_down", "the server is shutting down")

    async def _plan(
        self, body: dict[str, Any], stream_id: str | None, after: asyncio.Task[None] | None
    ) -> ResponsePlan:
        """Checks and tokenizes the event, then waits for the lane's previous response (FIFO within a
        lane); a socket that goes away meanwhile still counts the request, as cancelled."""
        try:
            plan = await plan_response(self.services, body, self._find, stream_id=stream_id)
            if after is not None:
                await asyncio.gather(after, return_exceptions=True)
            return plan
        except asyncio.CancelledError:
            self.services.generation.count_cancelled("responses")
            raise

    def _find(self, response_id: str) -> StoredResponse | None:
        return self.recent.get(response_id) or self.services.responses.get(self.key, response_id)

    def _cancel(self, event: dict[str, Any]) -> None:
        response_id, stream_id = event.get("response_id"), event.get("stream_id")
        run = (
            self.running.get(response_id)
            if isinstance(response_id, str)
            else next(
                (r for r in self.running.values() if stream_id is not None and r.builder.plan.stream_id == stream_id),
                None,
            )
        )
        if run is None:
            raise ServiceError(
                "unknown_id",
                f"no response in flight with response_id {response_id!r} / stream_id {stream_id!r}",
                "response_id",
            )
        run.stream.cancel()

    # ---- one response ------------------------------------------------------------------------------
    async def _respond(self, body: dict[str, Any], stream_id: str | None, after: asyncio.Task[None] | None) -> None:
        try:
            plan = await self._plan(body, stream_id, after)
            account, stream = await self.services.generation.submit(plan.prepared, "responses", api_key=self.key)
        except ServiceError as exc:
            self.emit_error(exc, stream_id)
            return
        except Exception:  # a bug must not leave the event without an answer
            logger.exception("responses_ws_admission_failed", stream_id=stream_id)
            self.emit_error(ServiceError("internal_error", "the response could not be started"), stream_id)
            return
        assert stream is not None
        run = self.running[plan.id] = ResponseRun(builder_for(self.services, plan), stream, account)
        try:
            async for event in run.events():
                await self.emit_in_turn(event)
            self._remember(run)
        finally:
            self.running.pop(plan.id, None)
            run.finish()

    def _remember(self, run: ResponseRun) -> None:
        if run.account.error is not None:
            return
        stored = run.builder.stored()
        self.recent[stored.id] = stored
        while len(self.recent) > self.services.config.max_requests_per_connection:
            self.recent.popitem(last=False)
        keep(self.services, self.key, run)


def _parse(text: str | None) -> dict[str, Any]:
    if text is None:
        raise ServiceError("invalid_request", "events must be text (JSON)")
    return loads_object(text, "the event")  # also refuses unencodable text and deep nesting, naming which
