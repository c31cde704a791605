"""What the HTTP routes share: reading a JSON body, answering with SSE, and aborting when the client leaves.

The route modules (`openai_routes`, `responses_api`, `tokenize_api`, `server_info`) import from here and
never from each other, so each route family can change alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Send

from streamd.logs import get_logger
from streamd.server.encoding import loads_object

logger = get_logger(__name__)
T = TypeVar("T")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# A route family's routes: (path, handler, methods), listed by the app.
RouteSpec = tuple[str, Callable[..., Any], list[str]]


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always lets go of its request, even if its body never started."""

    def __init__(self, content: AsyncIterator[str] | AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self._on_close()


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
