"""What the HTTP routes share: reading a JSON body, answering with SSE, and aborting when the client leaves.

Every SSE answer is an `SSEResponse`: while its body sends nothing for `server.sse_keepalive_s` it writes an
SSE comment (`: keepalive`), which clients ignore and which keeps a proxy's idle timeout (nginx's
`proxy_read_timeout`) from cutting a stream during a long prefill or queue wait.

The route modules (`openai_routes`, `responses_api`, `tokenize_api`, `server_info`) import from here (and
from `background_routes`, the background responses' routes they share) and never from each other, so each
route family can change alone.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Send

from streamd.logs import get_logger
from streamd.server.encoding import loads_object

logger = get_logger(__name__)
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keepalive\n\n"  # an SSE comment: every client skips it

# A route family's routes: (path, handler, methods), listed by the app.
RouteSpec = tuple[str, Callable[..., Any], list[str]]


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always lets go of its request, even if its body never started."""

    def __init__(
        self, content: AsyncIterator[str] | AsyncIterator[bytes], on_close: Callable[[], None], keepalive_s: float
    ) -> None:
        """`keepalive_s`: the silence after which a `: keepalive` comment is written (0: never; `server.
        sse_keepalive_s`, required so that no SSE route can leave it out)."""
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close
        self._keepalive_s = keepalive_s

    async def stream_response(self, send: Send) -> None:
        keeper = Keepalive(send, self._keepalive_s) if self._keepalive_s > 0 else None
        try:
            await super().stream_response(keeper.send if keeper is not None else send)
        finally:
            if keeper is not None:
                keeper.stop()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()


class Keepalive:
    """Wraps a response's `send`: once the head is out, a timer task writes `KEEPALIVE` whenever nothing was
    written for `interval_s`. No lock on the body's path (a lock cost ~3 us a chunk, ~15% of the null model's
    SSE serving): the timer writes only while no body write is in progress, and a body write that comes while
    the timer's comment is being written waits for it."""

    def __init__(self, send: Send, interval_s: float) -> None:
        self._send, self._interval_s = send, interval_s
        self._last = time.monotonic()
        self._timer: asyncio.Task[None] | None = None
        self._done = False
        self._body_writing = False
        self._comment: asyncio.Future[None] | None = None  # the timer's write in progress

    async def send(self, message: Message) -> None:
        while self._comment is not None:
            await self._comment
        self._body_writing = True
        try:
            await self._send(message)
        finally:
            self._body_writing = False
        self._last = time.monotonic()
        self._done = message["type"] == "http.response.body" and not message.get("more_body", False)
        if self._timer is None and not self._done:
            self._timer = asyncio.ensure_future(self._keep())

    def stop(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()

    async def _keep(self) -> None:
        """Sleeps until `interval_s` after the last write, then writes unless something did meanwhile; while a
        body write is stalled (a slow reader) it looks again an interval later, it does not poll."""
        try:
            while not self._done:
                wait = self._interval_s if self._body_writing else self._last + self._interval_s - time.monotonic()
                await asyncio.sleep(max(0.0, wait))
                if not (self._done or self._body_writing or time.monotonic() - self._last < self._interval_s):
                    await self._write_comment()
        except OSError:  # the client is gone: the body's next write (or the disconnect watch) ends the response
            return

    async def _write_comment(self) -> None:
        self._comment = asyncio.get_running_loop().create_future()
        try:
            await self._send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
            self._last = time.monotonic()
        finally:
            self._comment.set_result(None)
            self._comment = None


async def json_body(request: Request) -> dict[str, Any]:
    """The body (already bounded by `server.max_body_bytes` and checked to be JSON by `http_guard`)."""
    return loads_object(await request.body(), "the request body")


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Runs `work` to its result; cancels it (aborting its request) if the client disconnects first, and then
    answers 499 (nobody reads it)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        logger.info("client_disconnected")
        return Response(status_code=499)
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
