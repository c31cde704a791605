"""The HTTP/WebSocket service; talks to the engine only through AsyncEngine."""
