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
_BYTES = (bytes, memoryview)  # (a tuple, not `bytes | memoryview`: no union object made per chunk)

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
            if keeper is None:
                await super().stream_response(send)
            else:
                await self._stream_kept(send, keeper)
        finally:
            if keeper is not None:
                keeper.stop()
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()

    async def _stream_kept(self, send: Send, keeper: Keepalive) -> None:
        """StreamingResponse's loop with the keepalive's bookkeeping inline (no wrapper coroutine per chunk:
        at 256 streams the server's CPU is the limit, and a wrapped `send` cost ~0.5 us a chunk, ~1% of it)."""
        await keeper.send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            body = chunk if isinstance(chunk, _BYTES) else chunk.encode(self.charset)
            if keeper.comment is not None:  # (rare: the timer's comment is being written, to a slow reader)
                await keeper.comment_written()
            keeper.body_writing = True
            await send({"type": "http.response.body", "body": body, "more_body": True})
            keeper.body_writing = False
            keeper.writes += 1
        await keeper.send({"type": "http.response.body", "body": b"", "more_body": False})


class Keepalive:
    """A response's keepalive: once the head is out, a timer task writes `KEEPALIVE` into silence. The body's
    path only counts its writes (`writes`, `body_writing`: no lock, no clock; a lock cost ~3 us a chunk, ~15% of
    the null model's SSE serving). The timer wakes every half interval and writes when no write happened since
    its last wake and none is under way, so the first comment comes 1/2-1 interval into a silence and the next
    ones an interval apart; a write stalled on a slow reader is looked at again a half interval later, never
    polled. A body write that comes while the timer's comment is being written waits for it. `send` is the
    same bookkeeping around any message (the head, the last body, or a whole response written through it)."""

    def __init__(self, send: Send, interval_s: float) -> None:
        self._send, self._interval_s = send, interval_s
        self.writes = 0  # writes so far (body chunks and comments)
        self.body_writing = False
        self.comment: asyncio.Future[None] | None = None  # the timer's write in progress
        self.wakes = 0  # the timer's wake-ups (how often it looks)
        self._timer: asyncio.Task[None] | None = None
        self._done = False

    async def send(self, message: Message) -> None:
        await self.comment_written()
        self.body_writing = True
        try:
            await self._send(message)
        finally:
            self.body_writing = False
        self.writes += 1
        self._done = message["type"] == "http.response.body" and not message.get("more_body", False)
        if self._timer is None and not self._done:
            self._timer = asyncio.ensure_future(self._keep())

    async def comment_written(self) -> None:
        while self.comment is not None:  # (shielded: a cancelled writer must not cancel the timer's future)
            await asyncio.shield(self.comment)

    def stop(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()

    async def _keep(self) -> None:
        seen = -1  # (the first wake only notes the count)
        try:
            while not self._done:
                await asyncio.sleep(self._interval_s / 2)
                self.wakes += 1
                if self._done or self.body_writing or self.writes != seen:
                    seen = self.writes
                    continue
                await self._write_comment()
                seen = -1  # (the next wake only notes the count: comments an interval apart in silence)
        except OSError:  # the client is gone: the body's next write (or the disconnect watch) ends the response
            return

    async def _write_comment(self) -> None:
        self.comment = asyncio.get_running_loop().create_future()
        try:
            await self._send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
            self.writes += 1
        finally:
            written, self.comment = self.comment, None
            written.set_result(None)


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
