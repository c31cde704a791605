"""Connection limits and read deadlines for every client socket, below the ASGI app (uvicorn's protocols).

Why here: uvicorn hands the app a request only once its head has arrived, and it arms its keep-alive timer
only after a response. A socket that stays silent, trickles its head a byte at a time, or never finishes
the body its Content-Length declared therefore holds a file descriptor (and the body bytes read so far)
for as long as its client likes, without the app ever seeing it; with enough of them the process runs out
of descriptors and every new client fails, silently. So the HTTP protocol itself:

- counts every open socket, HTTP and WebSocket alike (a socket keeps its place across the upgrade until it
  closes), in all and per client address: over `server.max_open_connections` (lowered at start to stay
  256 descriptors under the process's file limit, which is first raised to its hard limit) or
  `server.max_connections_per_client`, a new socket is answered 503 `overloaded` at once and closed;
- gives each request `server.header_timeout_s` for its head (from the socket's opening, or from the first
  byte after a previous response) and `server.body_timeout_s` for its body (a body the app is not reading
  yet does not count against its client); past either it answers 408 `request_timeout` and closes;
- keeps the body bytes of requests still arriving, over every socket together, under
  `server.max_pending_body_bytes`: the request whose body would pass it is answered 503 and closed.

Refusals are logged at most once a second per kind (`connection_refused`, with how many were refused
since the last line), so a flood of sockets costs no flood of log lines. An idle keep-alive socket is
closed by uvicorn after `server.keep_alive_timeout_s`.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from streamd.config import ServerConfig
from streamd.logs import get_logger
from streamd.server.errors import ServiceError, error_response
from streamd.server.http.pipelining import PipelinedHttpProtocol
from streamd.server.ws.handshake import GuardedWebSocketProtocol

logger = get_logger(__name__)
FD_HEADROOM = 256  # descriptors kept free beside the sockets: model files, pipes, logs, the engine's own


def open_file_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit (every socket is a descriptor) and
    returns the soft limit then in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            logger.warning("fd_limit_not_raised", soft=soft, hard=hard)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


@dataclass(slots=True, frozen=True)
class ConnectionLimits:
    max_open: int  # sockets at once, HTTP and WebSocket
    max_per_client: int  # sockets at once from one client address; 0: no limit
    header_timeout_s: float
    body_timeout_s: float
    max_pending_body_bytes: int  # body bytes of requests still arriving, every socket together

    @classmethod
    def of(cls, server: ServerConfig, fd_limit: int) -> ConnectionLimits:
        """The configured limits, the total lowered to stay FD_HEADROOM descriptors under `fd_limit`."""
        max_open = max(1, min(server.max_open_connections, fd_limit - FD_HEADROOM))
        if max_open < server.max_open_connections:
            logger.warning("connection_limit_lowered", configured=server.max_open_connections, fd_limit=fd_limit)
        return cls(
            max_open,
            server.max_connections_per_client,
            server.header_timeout_s,
            server.body_timeout_s,
            server.max_pending_body_bytes,
        )


@dataclass(slots=True)
class _Notices:
    """At most one log line a second per kind of refusal, saying how many there were since the last."""

    last: dict[str, float] = field(default_factory=dict)
    unlogged: Counter[str] = field(default_factory=Counter)

    def refused(self, reason: str, client: str) -> None:
        self.unlogged[reason] += 1
        now = time.monotonic()
        if now - self.last.get(reason, -1.0) >= 1.0:
            self.last[reason] = now
            logger.warning("connection_refused", reason=reason, client=client, count=self.unlogged.pop(reason))


class ConnectionGate:
    """The sockets open now (per transport, so a WebSocket upgrade keeps its place) and per client address,
    and the body bytes in transit. The one place these limits are checked."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._clients: dict[object, str] = {}  # transport -> client address
        self._per_client: Counter[str] = Counter()
        self.pending_body_bytes = 0
        self.notices = _Notices()

    @property
    def num_open(self) -> int:
        return len(self._clients)

    def admit(self, transport: object, client: str) -> ServiceError | None:
        """Counts the socket in, or says why it is refused."""
        limits = self.limits
        if len(self._clients) >= limits.max_open:
            return self._refused("total", client, f"the server has {limits.max_open} connections open (its limit)")
        if limits.max_per_client and self._per_client[client] >= limits.max_per_client:
            return self._refused(
                "per_client",
                client,
                f"this address has {limits.max_per_client} connections open (server.max_connections_per_client)",
            )
        self._clients[transport] = client
        self._per_client[client] += 1
        return None

    def release(self, transport: object) -> None:
        client = self._clients.pop(transport, None)
        if client is not None:
            self._per_client[client] -= 1
            if not self._per_client[client]:
                del self._per_client[client]

    def hold_body(self, size: int, client: str) -> ServiceError | None:
        """Counts `size` more body bytes in transit, or says why they are refused."""
        if self.pending_body_bytes + size > self.limits.max_pending_body_bytes:
            return self._refused("body_bytes", client, "the server holds too many request bodies in transit")
        self.pending_body_bytes += size
        return None

    def free_body(self, size: int) -> None:
        self.pending_body_bytes -= size

    def timed_out(self, phase: str, client: str, timeout_s: float) -> ServiceError:
        self.notices.refused(f"{phase}_timeout", client)
        return ServiceError(
            "request_timeout", f"the request {phase} did not arrive within {timeout_s:g} s (server.{phase}_timeout_s)"
        )

    def _refused(self, reason: str, client: str, why: str) -> ServiceError:
        self.notices.refused(reason, client)
        return ServiceError("overloaded", f"{why}; retry later")


def http_answer(error: ServiceError) -> bytes:
    """A whole HTTP/1.1 answer that closes the connection, for a refusal made before or beside the app: the
    app's own (`error_response`: OpenAI error body, `Retry-After` on a 503 that a retry may pass)."""
    response = error_response(error, headers={"connection": "close"})
    head = b"".join(b"%s: %s\r\n" % header for header in response.raw_headers)
    return STATUS_LINE[response.status_code] + head + b"\r\n" + response.body


class GatedHttpProtocol(PipelinedHttpProtocol):
    """uvicorn's httptools protocol under the gate's limits and the read deadlines (module docstring)."""

    gate: ClassVar[ConnectionGate]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._reading: str | None = None  # "header" or "body" while a request arrives
        self._body_bytes = 0  # of the arriving body, counted in the gate
        self._refused = False

    @property
    def _client(self) -> str:
        return self.client[0] if self.client else ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        refusal = self.gate.admit(transport, self._client)
        if refusal is not None:
            self._refuse(refusal)
            return
        self._read("header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_reading()
        self.gate.release(self.transport)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading is None:
            self._read("header")
        super().data_received(data)

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        super().on_headers_complete()
        upgrading = self.parser.should_upgrade() and self._should_upgrade()
        if upgrading:
            self._stop_reading()  # the WebSocket protocol takes the socket over
        else:
            self._read("body")

    def on_body(self, body: bytes) -> None:
        if self._refused:
            return
        refusal = self.gate.hold_body(len(body), self._client)
        if refusal is not None:
            self._refuse(refusal)
            return
        self._body_bytes += len(body)
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._refused:
            return
        self._stop_reading()
        super().on_message_complete()

    def _read(self, phase: str) -> None:
        """A new deadline: the request's `phase` ("header" or "body") must arrive within its timeout."""
        if self._deadline is not None:
            self._deadline.cancel()
        self._reading = phase
        limits = self.gate.limits
        timeout_s = limits.header_timeout_s if phase == "header" else limits.body_timeout_s
        self._deadline = self.loop.call_later(timeout_s, self._expired, phase, timeout_s)

    def _stop_reading(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._reading = None
        self.gate.free_body(self._body_bytes)
        self._body_bytes = 0

    def _expired(self, phase: str, timeout_s: float) -> None:
        self._deadline = None
        if self.flow.read_paused:  # the app (or a pipelined request ahead) is not reading: not the client's fault
            self._read(phase)
            return
        self._refuse(self.gate.timed_out(phase, self._client, timeout_s))

    def _refuse(self, error: ServiceError) -> None:
        """Answers `error` (unless a response already began), ends the request in flight and closes."""
        self._refused = True
        self._stop_reading()
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            self.transport.write(http_answer(error))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive says disconnect, its sends go nowhere
            cycle.message_event.set()
        self.transport.close()


class GatedWebSocketProtocol(GuardedWebSocketProtocol):
    """The WebSocket protocol a gated HTTP socket upgrades to: it gives the socket's place back on close."""

    gate: ClassVar[ConnectionGate]

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate.release(self.transport)
        super().connection_lost(exc)


def gated_protocols(
    gate: ConnectionGate, ws_close_timeout_s: float
) -> tuple[type[GatedHttpProtocol], type[GatedWebSocketProtocol]]:
    """The protocol classes uvicorn builds each socket's protocol from, bound to `gate` (the WebSocket one
    with `server.ws_close_timeout_s`)."""

    class Http(GatedHttpProtocol):
        pass

    class WebSocket(GatedWebSocketProtocol):
        pass

    Http.gate = WebSocket.gate = gate
    WebSocket.close_timeout_s = ws_close_timeout_s
    return Http, WebSocket
