"""Helpers for the reliability suite: the limits its servers run with, raw sockets for what real clients
refuse to send, waiting for a server to let go of every connection, counting file descriptors."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from tests.server.util import Server

# Small limits so that "at and over every limit" stays cheap.
LIMITS: dict[str, Any] = {
    "max_frame_bytes": 65536, "max_requests_per_connection": 8, "max_prompt_chars": 9000,
    "max_body_bytes": 65536, "default_max_tokens": 4, "max_tokens_limit": 256,
    "resume_grace_s": 1.0,  # a dropped socket's requests are aborted 1 s later (the default 30 s is waited out)
}
SETTLE_S = 30.0


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


async def settle(server: Server) -> None:
    """Waits (polling a condition, with a deadline) until the server holds no connection of any kind."""
    deadline = time.monotonic() + SETTLE_S
    state = server.uvicorn.server_state
    while state.connections or server.services.lifecycle.num_connections:
        assert time.monotonic() < deadline, f"connections still open: {len(state.connections)}"
        await asyncio.sleep(0.01)


@dataclass
class HttpAnswer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader) -> HttpAnswer:
    """One HTTP/1.1 response with a Content-Length body (what the server sends for JSON answers)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), 60)
    return HttpAnswer(status, headers, body)


def post_bytes(path: str, body: bytes, content_type: str = "application/json", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def upgrade_bytes(extra_headers: list[tuple[str, str]]) -> bytes:
    lines = ["GET /v1/stream HTTP/1.1", "Host: 127.0.0.1", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13",
             *(f"{k}: {v}" for k, v in extra_headers)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_to_close(reader: asyncio.StreamReader, timeout: float = 30) -> bytes:
    """Everything the server sends until it closes (fails if it never does)."""
    return await asyncio.wait_for(reader.read(), timeout)
