"""The engine's faces for asyncio code. The server types against `EngineClient` (protocol.py) and never
names an implementation:

- loop.py: `EngineLoop`, the one loop that drives an `LLMEngine` (commands, step, publish), and its records;
- async_engine.py: `AsyncEngine`, the client whose loop runs on a thread of this process;
- engine_process.py / engine_child.py: `ProcessEngine`, the client whose loop runs in a child process;
- deliveries.py: what both clients share on the event loop (each request's sink, admissions, stats);
- wire.py: how records cross the process boundary (one codec derived from the dataclasses);
- request_stream.py: the sinks deltas go to (`RequestStream`, `PendingDelta`, `Backpressure`).
"""
