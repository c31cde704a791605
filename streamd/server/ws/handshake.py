"""uvicorn's websockets (sans-I/O) protocol, with oversized or malformed handshakes answered and closed, and
closes that a client which stopped reading cannot stall.

The websockets parser refuses a handshake with a header line over 8 KiB or more than 128 headers (431),
or a request line too long (414), and prepares that answer; uvicorn 0.54 never writes it and never closes
the socket, so such a handshake would hold its connection (and file descriptor) for as long as the client
liked. `GuardedWebSocketProtocol` writes the prepared answer and closes. It also counts a denial response
(how ws.py refuses a handshake: 401, 403, 503) as the handshake's answer, so uvicorn does not log every
refused handshake at ERROR ("ASGI callable returned without completing handshake").

Closing: uvicorn writes the close frame only once the transport's buffer has room (with no timeout), and
when the peer never answers it closes the transport gracefully, which waits for the buffer to reach a peer
that no longer reads. So a server-side close (the drain's 1012, a 1008 for a client that does not read
its replies) of a stalled socket never finished, and held the drain and a file descriptor until the
client went away. Here the close waits at most `close_timeout_s` (`server.ws_close_timeout_s`) for room
and, after the close frame, for the peer's answer; then the transport is aborted. Everything else is
uvicorn's.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

logger = logging.getLogger("streamd.server.ws.stream")


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
    close_timeout_s = 5.0  # set per server by `connections.gated_protocols`

    def data_received(self, data: bytes) -> None:
        if self.handshake_initiated:
            super().data_received(data)
            return
        self.conn.receive_data(data)
        refused = self.conn.handshake_exc
        if refused is None:
            self.handle_events()
            return
        logger.info("ws_handshake_refused: %s", refused)
        self.handshake_initiated = self.handshake_complete = self.close_sent = True
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.transport.close()

    async def send(self, message: ASGISendEvent) -> None:
        if message["type"] == "websocket.close" and self.handshake_complete and not await self._room_to_close():
            return
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True  # the denial response answered the handshake
        if message["type"] == "websocket.close" and self.close_timer is not None:
            self.close_timer.cancel()  # no answer to the close frame in time: abort, not a graceful close
            self.close_timer = self.loop.call_later(self.close_timeout_s, self._abort, "close_unanswered")

    async def _room_to_close(self) -> bool:
        """Waits until the close frame can be written; False (the transport aborted) after the timeout."""
        try:
            await asyncio.wait_for(self.writable.wait(), self.close_timeout_s)
        except TimeoutError:
            self._abort("close_unwritable")
            return False
        return True

    def _abort(self, why: str) -> None:
        """The peer stopped reading: drop the connection (and whatever it did not read) at once."""
        if not self.transport.is_closing() or self.transport.get_write_buffer_size():
            logger.info("ws_close_forced: %s", why)
            self.transport.abort()
