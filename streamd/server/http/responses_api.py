"""`POST /v1/responses`: the OpenAI Responses API over HTTP, as JSON or as SSE events; with `background: true`
the response runs detached (`server/background.py`) and `GET /v1/responses/{id}` (JSON, or SSE with
`stream=true&starting_after=N`: the kept events after N, then the live ones), `POST /v1/responses/{id}/cancel`
and `DELETE /v1/responses/{id}` reach it, for the API key that created it.

The request checks, the events and the store live in the Responses API's core (`streamd/server/responses.py`,
shared with WebSocket mode); this module is the HTTP route around them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamd.server.auth import api_key
from streamd.server.encoding import dumps
from streamd.server.errors import ServiceError
from streamd.server.http.background_routes import BackgroundRoutes
from streamd.server.http.common import RouteSpec, SSEResponse, json_body, until_disconnect
from streamd.server.responses import ResponseRun, builder_for, keep, plan_response
from streamd.server.services import Services


async def create_response(request: Request) -> Response:
    s: Services = request.app.state.services
    body = await json_body(request)
    key = api_key(request.headers)
    if "stream_id" in body:
        raise ServiceError("invalid_request", "stream_id is for WebSocket mode only", "stream_id")
    plan = await plan_response(s, body, lambda rid: s.responses.get(key, rid))
    if plan.background:
        s.background.make_room()  # (refused before it takes any engine work)
    account, stream = await s.generation.submit(plan.prepared, "responses", api_key=key)
    assert stream is not None
    run = ResponseRun(builder_for(s, plan), stream, account)
    structlog.contextvars.bind_contextvars(request_id=plan.id)
    if plan.background:
        record = s.background.start(key, "responses", run, lambda: keep(s, key, run))
        return _BACKGROUND.follow(s, record, -1) if plan.stream else JSONResponse(record.response())
    if plan.stream:
        return SSEResponse(_sse(s, key, run), run.finish, s.config.sse_keepalive_s)
    return await until_disconnect(request, _collect(s, key, run))


async def _sse(s: Services, key: str, run: ResponseRun) -> AsyncIterator[str]:
    async for event in run.events():
        yield _event(event)
    keep(s, key, run)


def _event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


_BACKGROUND = BackgroundRoutes(
    "/v1/responses", "responses", "response", lambda _number, event: _event(event).encode(), json_unless_stream=True
)


async def _collect(s: Services, key: str, run: ResponseRun) -> Response:
    try:
        async for _ in run.events():
            pass
    finally:
        run.finish()
    if run.account.error:
        raise ServiceError("internal_error", run.account.error)
    keep(s, key, run)
    return JSONResponse(run.builder.response(run.account))


def make_routes() -> list[RouteSpec]:
    return [
        ("/v1/responses", create_response, ["POST"]),
        *_BACKGROUND.routes(),
    ]
