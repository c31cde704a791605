"""The HTTP routes that reach background responses (`server/background.py`), one piece for every route family
that can start them: `POST /v1/responses` with `background: true`, and chat completions and completions with
streamd's `streamd_background: true`.

Per family (`BackgroundRoutes`): `GET {base}/{id}` follows it over SSE from `starting_after=N` (or SSE's
`Last-Event-ID: N` header; the Responses API answers JSON unless `stream=true`), `POST {base}/{id}/cancel`
aborts it and answers it as it ended, `DELETE {base}/{id}` aborts and forgets it; each for the API key that
created it. A family differs only in how an event is written (`encode`) and in its objects' names, so the
route modules (`openai_routes`, `responses_api`) each hold a `BackgroundRoutes` and never each other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamd.server.auth import api_key
from streamd.server.background import BackgroundResponse
from streamd.server.errors import ServiceError
from streamd.server.http.common import RouteSpec, SSEResponse
from streamd.server.services import Services

Encode = Callable[[int, Any], bytes]  # (the event's number, the event) -> its SSE bytes


@dataclass(frozen=True, slots=True)
class BackgroundRoutes:
    """One route family's background responses over HTTP."""

    base: str  # "/v1/responses", "/v1/chat/completions", "/v1/completions"
    kind: str  # the `BackgroundResponses` kind ("responses", "chat", "completion")
    deleted_object: str  # the `object` of a DELETE's answer
    encode: Encode
    json_unless_stream: bool = False  # GET answers the `response` object unless `stream=true` (Responses)

    def follow(self, s: Services, record: BackgroundResponse, starting_after: int) -> SSEResponse:
        """Its events after `starting_after`, then the live ones; a reader that leaves does not stop it."""

        async def events() -> AsyncIterator[bytes]:
            async for number, event in record.replay(starting_after):
                yield self.encode(number, event)

        return SSEResponse(events(), lambda: None, s.config.sse_keepalive_s)

    async def retrieve(self, request: Request) -> Response:
        s, record = self._record(request)
        if self.json_unless_stream and not _stream_asked(request):
            return JSONResponse(record.response())
        return self.follow(s, record, _starting_after(request))

    async def cancel(self, request: Request) -> Response:
        """Aborts it if it still runs; answers it as it ended (status `cancelled`, or how it had ended)."""
        s: Services = request.app.state.services
        record = s.background.cancel(api_key(request.headers), self.kind, request.path_params["id"])
        return JSONResponse(await record.ended())

    async def delete(self, request: Request) -> Response:
        s: Services = request.app.state.services
        response_id = request.path_params["id"]
        s.background.delete(api_key(request.headers), self.kind, response_id)
        return JSONResponse({"id": response_id, "object": self.deleted_object, "deleted": True})

    def routes(self) -> list[RouteSpec]:
        return [
            (self.base + "/{id}", self.retrieve, ["GET"]),
            (self.base + "/{id}", self.delete, ["DELETE"]),
            (self.base + "/{id}/cancel", self.cancel, ["POST"]),
        ]

    def _record(self, request: Request) -> tuple[Services, BackgroundResponse]:
        s: Services = request.app.state.services
        return s, s.background.get(api_key(request.headers), self.kind, request.path_params["id"])


def _stream_asked(request: Request) -> bool:
    stream = request.query_params.get("stream", "false")
    if stream not in ("true", "false"):
        raise ServiceError("invalid_request", f"stream must be true or false, got {stream!r}", "stream")
    return stream == "true"


def _starting_after(request: Request) -> int:
    """The number of the last event the reader has (`starting_after`, else `Last-Event-ID`); -1: none."""
    after = request.query_params.get("starting_after", request.headers.get("last-event-id", "-1"))
    try:
        return int(after)
    except ValueError:
        raise ServiceError(
            "invalid_request", f"starting_after must be an integer, got {after!r}", "starting_after"
        ) from None
