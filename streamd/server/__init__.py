"""The HTTP/WebSocket service: `http/` and `ws/` wings around shared request handling; it talks to the engine
only through an `EngineClient` and imports only the engine's public package (`streamd.engine`)."""
