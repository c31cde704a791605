"""uvicorn's websockets (sans-I/O) protocol, with oversized or malformed handshakes answered and closed.

The websockets parser refuses a handshake with a header line over 8 KiB or more than 128 headers (431),
or a request line too long (414), and prepares that answer; uvicorn 0.54 never writes it and never closes
the socket, so such a handshake would hold its connection (and file descriptor) for as long as the client
liked. `GuardedWebSocketProtocol` writes the prepared answer and closes. It also counts a denial response
(how ws.py refuses a handshake: 401, 403, 503) as the handshake's answer, so uvicorn does not log every
refused handshake at ERROR ("ASGI callable returned without completing handshake"). Everything else is
uvicorn's.
"""

from __future__ import annotations

import logging

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

logger = logging.getLogger("streamd.server.ws.stream")


class GuardedWebSocketProtocol(WebSocketsSansIOProtocol):
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
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            self.handshake_complete = True  # the denial response answered the handshake
