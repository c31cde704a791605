"""The engine's faces for asyncio code: the engine loop on a thread or in its own process, and the request
streams (sinks) its deltas go to. The server types against `EngineClient`."""
