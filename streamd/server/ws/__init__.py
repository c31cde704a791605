"""The WebSocket wing: the `/v1/stream` protocol (framing, resume, stats feed), the Responses API's WebSocket
mode, and what both endpoints share (accepting a socket, handshake limits)."""
