"""`WS /v1/stream`: many requests multiplexed on one socket, in `streamd.v1` or `streamd.v2` framing.

One `Connection` per socket: a reader loop parses frames and starts an admission task per `generate`;
each admitted request is a `WsRequest`, the `DeltaSink` its engine deltas go to. One writer task per
connection sends everything: when it wakes it takes every request that has something new (typically one
engine step's deltas of all of them), builds their `start` / `delta` / `done` / `error` frames and writes
them, as one message in v2 or one message per frame in v1. While the client is slow the writer waits in
`send` and new deltas merge into each request's pending delta; past `server.max_unsent_tokens` unsent
tokens the request is paused in the engine (`Backpressure`) until the writer takes them.

Resumable requests (resume.py): when the socket drops, admitted requests are detached instead of aborted:
their frames are built at once into their retained output, and a `resume` frame on another socket attaches
them there (replay, then the live stream). The handshake policy, the drain's 1012 close and the reader
loop are ws_socket.py's (shared with responses_ws.py); oversize frames are closed with 1009 by uvicorn
(`ws_max_size`). A connection that sends `subscribe_stats` also gets the live engine view (`stats`
frames, stats_feed.py); only the newest unsent one is kept, so a slow reader never queues them up.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from streamd.engine import Backpressure, PendingDelta, RequestDelta
from streamd.logs import get_logger
from streamd.server.accounting import RequestAccount
from streamd.server.errors import ServiceError, queue_timed_out
from streamd.server.generation import Prepared, split_user
from streamd.server.services import Services
from streamd.server.structured_api import plan_tools, with_enforced_call
from streamd.server.tool_parsers import ToolCallParser
from streamd.server.ws import protocol
from streamd.server.ws.resume import Retention
from streamd.server.ws.socket import SocketConnection, accept
from streamd.server.ws.stats_feed import StatsFeed

logger = get_logger(__name__)
PROGRESS_INTERVAL_S = 0.2  # at most this often a request's `progress` frame (the engine reports per chunk)


async def stream_endpoint(websocket: WebSocket) -> None:
    offered = websocket.scope.get("subprotocols", [])
    chosen = next((p for p in protocol.SUBPROTOCOLS if p in offered), None)
    services = await accept(websocket, chosen)
    if services is None:
        return
    await Connection(websocket, services, batched=chosen == protocol.SUBPROTOCOL_V2).run()


class WsRequest:
    """One request in flight on a connection: its admission, its pending delta, its frame sequence."""

    __slots__ = (
        "account",
        "cancel_requested",
        "client_id",
        "connection",
        "finished",
        "pending",
        "prepared",
        "progress_sent",
        "replay",
        "resume_token",
        "retention",
        "seq",
        "start_sent",
        "task",
        "tool_format",
        "tool_parsers",
        "tools_flushed",
    )

    def __init__(self, client_id: str, connection: Connection) -> None:
        self.client_id = client_id
        self.prepared: Prepared | None = None  # set once tokenized and checked
        self.connection: Connection | None = connection  # None while detached (its socket dropped)
        self.account: RequestAccount | None = None  # set once admitted
        self.pending = PendingDelta()  # its backpressure is set once admitted
        self.retention: Retention | None = None  # set once admitted when resumable
        self.resume_token: str | None = None
        self.replay: list[protocol.Frame] = []  # retained frames a resume asked for, sent first
        self.task: asyncio.Task[None] | None = None
        self.seq = 0
        self.start_sent = False
        self.cancel_requested = False
        self.finished = False  # its done frame is built (the account closes once it is sent)
        self.tool_format: str | None = None  # with tools: the format its replies' calls are parsed in
        self.tool_parsers: dict[int, ToolCallParser] = {}  # per choice, with a tool_format
        self.tools_flushed: set[int] = set()  # choices whose parser had its final feed
        self.progress_sent = 0.0  # monotonic time of its last `progress` frame

    def put(self, delta: RequestDelta) -> None:
        """DeltaSink: merge, and tell the writer (or, detached, retain the frames now)."""
        self.pending.add(delta)
        if self.connection is None:
            self.build_detached()
        else:
            self.connection.wake(self)

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.account is not None:
            self.account.cancel()

    def build_detached(self) -> None:
        """No socket: the frames only go to the retained output; the account closes on the final delta."""
        self.frames()
        if self.finished and self.account is not None:
            self.account.close()

    def expire(self, reason: str, cause: str) -> None:
        """Resumable and detached: the grace period ended without a resume, or the server drains
        (resume.py); abort it if still running (`cause`: the account's cancellation cause)."""
        self.retention = None
        if not self.finished and self.account is not None:
            self.account.cancel(cause)

    def frames(self) -> list[protocol.Frame]:
        """What this request has to send now (nothing before it is admitted)."""
        account, prepared = self.account, self.prepared
        if account is None or prepared is None:
            return []
        frames = []
        if not self.start_sent:
            frames.append(
                protocol.start_frame(
                    self.client_id, len(prepared.prompt_token_ids), self.resume_token, prepared.service_tier
                )
            )
            self.start_sent = True
        frames.extend(self.replay)
        self.replay = []
        delta = self.pending.take()
        if delta is None:
            return frames
        account.absorb(delta)
        frames.extend(self._progress(delta, len(prepared.prompt_token_ids)))
        built = []
        for choice in delta.outputs:
            text, calls = self._parsed(choice.index, choice.text, choice.finish_reason is not None)
            if text or choice.token_ids or calls:
                built.append(
                    protocol.delta_frame(
                        self.client_id, self.seq, text, choice.token_ids, choice.index, choice.logprobs, calls
                    )
                )
                self.seq += 1
        if delta.finished:
            built += self._flush_tools()
            if delta.error is not None:
                built.append(protocol.error_frame(self.client_id, ServiceError("internal_error", delta.error)))
            if account.overloaded:
                built.append(protocol.error_frame(self.client_id, queue_timed_out()))
            built.append(
                protocol.done_frame(
                    self.client_id,
                    self._finish_name(0, account.finish.wire),
                    account.usage(),
                    [self._finish_name(i, finish.wire) for i, finish in enumerate(account.choice_finishes())],
                    account.drained,
                )
            )
            self.finished = True
            if self.connection is not None:
                self.connection.forget(self)
        if self.retention is not None:
            self._retain(built)
        frames.extend(built)
        return frames

    def _progress(self, delta: RequestDelta, prompt_tokens: int) -> list[protocol.Frame]:
        """A `progress` frame before the first delta frame, at most one per PROGRESS_INTERVAL_S (the engine
        repeats a waiting request's place every second); never retained for a resume (it has no seq)."""
        if delta.progress is None or self.seq or delta.finished or delta.num_new_tokens:
            return []  # (checked first: after the first token every delta ends here, without a clock read)
        now = time.monotonic()
        if now - self.progress_sent < PROGRESS_INTERVAL_S:
            return []
        self.progress_sent = now
        return [protocol.progress_frame(self.client_id, prompt_tokens, delta.progress)]

    def _parsed(self, index: int, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """A choice's new text as (content, tool-call deltas): through its tool-call parser when the request
        has tools (the text a call is made of is withheld; `final` releases what was held back)."""
        if self.tool_format is None:
            return text, []
        parser = self.tool_parsers.get(index)
        if parser is None:
            parser = self.tool_parsers[index] = ToolCallParser(self.tool_format)
        out = parser.feed(text, final)
        if final:
            self.tools_flushed.add(index)
        return out.content, out.tool_calls

    def _flush_tools(self) -> list[protocol.Frame]:
        """At the end: what choices that ended without a last delta of their own still held back."""
        frames = []
        for index in sorted(set(self.tool_parsers) - self.tools_flushed):
            text, calls = self._parsed(index, "", True)
            if text or calls:
                frames.append(protocol.delta_frame(self.client_id, self.seq, text, [], index, None, calls))
                self.seq += 1
        return frames

    def _finish_name(self, index: int, wire: str) -> str:
        """ "tool_calls" for a choice that stopped with a complete call, else the finish's wire name."""
        parser = self.tool_parsers.get(index)
        return "tool_calls" if wire == "stop" and parser is not None and parser.called else wire

    def _retain(self, built: list[protocol.Frame]) -> None:
        """Keeps the frames for a resume; past a bound the request is aborted with an error saying so."""
        assert self.retention is not None and self.account is not None
        store = self.retention.store
        over = next(
            (
                why
                for frame in built
                if (why := store.retain(self.retention, frame, len(frame.get("token_ids", ())))) is not None
            ),
            None,
        )
        if over is not None:  # never truncated silently: the request ends, saying why
            built.append(
                protocol.error_frame(
                    self.client_id, ServiceError("resume_retention_exceeded", f"request aborted: {over}")
                )
            )
            store.release(self.retention, over)
            self.retention = None
            self.account.cancel()


class Connection(SocketConnection):
    def __init__(self, websocket: WebSocket, services: Services, batched: bool) -> None:
        super().__init__(websocket, services)
        self.batched = batched
        self.live: dict[str, WsRequest] = {}
        self._ready: dict[WsRequest, None] = {}  # requests with something to send, in order
        self._control: list[protocol.Frame] = []  # error frames not tied to a live request
        self._stats: protocol.Frame | None = None  # the newest unsent stats frame
        self.stats_feed = StatsFeed(services.engine, self.push_stats, services.generation.tenants.label)
        self._wake = asyncio.Event()

    def _describe(self) -> dict[str, Any]:
        return {"batched": self.batched}

    async def _let_go(self) -> None:
        """The socket is gone: stop the stats feed and cancel admissions; detach resumable requests, abort
        the others (accounts close on the final deltas)."""
        self.stats_feed.stop()
        tasks = [r.task for r in self.live.values() if r.task is not None and not r.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for request in list(self.live.values()):
            if request.retention is not None:
                self._detach(request)
            else:
                request.cancel()

    def _detach(self, request: WsRequest) -> None:
        assert request.retention is not None
        self.forget(request)
        if request.connection is self:
            request.connection = None
            request.retention.store.detach(request.retention)
            request.build_detached()

    # ---- writing -----------------------------------------------------------------------------------
    def wake(self, request: WsRequest) -> None:
        if self.closed:
            if request.retention is not None:
                self._detach(request)
            else:
                self._drop_unsent(request)
            return
        self._ready[request] = None
        self._wake.set()

    def forget(self, request: WsRequest) -> None:
        if self.live.get(request.client_id) is request:  # (its id may be in use again by a newer request)
            del self.live[request.client_id]

    def _drop_unsent(self, request: WsRequest) -> None:
        """After the socket closed: nothing is sent, but the account still takes the deltas."""
        delta = request.pending.drop()
        if delta is not None and request.account is not None:
            request.account.absorb(delta)
            if delta.finished:
                request.account.close()
                self.forget(request)

    def send_error(self, client_id: str | None, error: ServiceError) -> None:
        if not self.closed:
            self._control.append(protocol.error_frame(client_id, error))
            self._wake.set()
            self.check_backlog(len(self._control))

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
            ready = [r for r in self._ready if r.connection is self]  # (a resume elsewhere took it)
            self._ready = {}
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
            for request in ready:
                if request.finished and request.retention is not None:
                    if self.closed:  # its done may not have arrived: keep it for a resume
                        self._detach(request)
                    else:  # written: resumable for the grace period (or until the client's ack)
                        request.retention.store.delivered(request.retention)
            if self.closed:
                return

    # ---- reading -----------------------------------------------------------------------------------
    def _on_message(self, text: str | None) -> None:
        if text is None:
            self.send_error(None, ServiceError("invalid_request", "frames must be text (JSON)"))
            return
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
        if isinstance(frame, protocol.Resume):
            self._resume(frame)
            return
        if isinstance(frame, protocol.Ack):
            self._ack(frame)
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
        self._check_slot(client_id)
        if self.services.lifecycle.draining:
            raise ServiceError("shutting_down", "the server is shutting down")

    def _check_slot(self, client_id: str) -> None:
        """Raises ServiceError if `client_id` cannot be one more live request (a generate or a resume)."""
        if client_id in self.live:
            raise ServiceError("duplicate_id", f"id {client_id!r} is already in flight")
        if len(self.live) >= self.services.config.max_requests_per_connection:
            raise ServiceError(
                "too_many_requests",
                "too many requests in flight on this connection "
                f"(limit {self.services.config.max_requests_per_connection})",
            )

    async def _prepare(self, request: WsRequest, frame: protocol.Generate) -> Prepared:
        """Tokenizes (off the loop when long) and checks a generate frame; raises ServiceError. Tools go
        through the OpenAI routes' `plan_tools`: the request's `tool_format` says how its calls are read."""
        gen, (params, user) = self.services.generation, split_user(frame.params)
        if frame.messages is not None:
            plan = plan_tools(frame.tools, frame.tool_choice, self.services.tool_format)
            if plan is not None and plan.structured is not None:
                params = with_enforced_call(params, plan.structured)
            request.tool_format = plan.parser if plan is not None else None
            tools = plan.tools if plan is not None else None
            ids, prompt, param = await gen.messages_ids(frame.messages, tools), None, "messages"
        else:
            ids = await gen.prompt_ids(frame.prompt)
            prompt, param = (frame.prompt if isinstance(frame.prompt, str) else None), "prompt"
        default_max_tokens = self.services.config.default_max_tokens
        return gen.prepare(
            ids, params, default_max_tokens=default_max_tokens, prompt=prompt, prompt_param=param, user=user
        )

    def _resume(self, frame: protocol.Resume) -> None:
        """Attaches a resumable request to this socket: the frames after `after_seq`, then the live stream."""
        store = self.services.resumes
        try:
            self._check_slot(frame.id)
            retention, replay = store.claim(frame.id, frame.resume_token, frame.after_seq, self.api_key)
        except ServiceError as exc:
            self.send_error(frame.id, exc)
            return
        request = retention.owner
        assert isinstance(request, WsRequest)
        previous = request.connection
        if previous is not None and previous is not self:  # its old socket is not known to be gone yet
            previous.forget(request)
        request.connection = self
        request.replay = replay
        if not request.finished:
            self.live[frame.id] = request
        logger.info("ws_resumed", id=frame.id, after_seq=frame.after_seq, replayed=len(replay))
        self.wake(request)

    def _ack(self, frame: protocol.Ack) -> None:
        try:
            self.services.resumes.acknowledge(frame.id, frame.resume_token, self.api_key)
        except ServiceError as exc:
            self.send_error(frame.id, exc)

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
                request.prepared = await self._prepare(request, frame)
            except asyncio.CancelledError:
                gen.count_cancelled("ws")  # the socket went away while it was tokenized
                raise
            account, _ = await gen.submit(request.prepared, "ws", sink=request, api_key=self.api_key)
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
        config, engine = self.services.config, self.services.engine
        pending = request.pending
        pending.backpressure = Backpressure(account.request_id, config.max_unsent_tokens, engine.set_paused)
        pending.backpressure.update(pending.unsent)
        if self.services.resumes.enabled:
            request.retention, request.resume_token = self.services.resumes.open(
                request.client_id, self.api_key, request
            )
        if request.cancel_requested:
            account.cancel()
        self.wake(request)
