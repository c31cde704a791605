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

from streamd.server.background import BackgroundResponse
from streamd.server.encoding import dumps
from streamd.server.errors import ServiceError
from streamd.server.http.common import RouteSpec, SSEResponse, json_body, until_disconnect
from streamd.server.responses import ResponseRun, api_key, builder_for, keep, plan_response
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
        record = s.background.start(key, "responses", run, lambda k, _: keep(s, k, run))
        return _follow(s, record, -1) if plan.stream else JSONResponse(record.response())
    if plan.stream:
        return SSEResponse(_sse(s, key, run), run.finish, s.config.sse_keepalive_s)
    return await until_disconnect(request, _collect(s, key, run))


async def _sse(s: Services, key: str, run: ResponseRun) -> AsyncIterator[str]:
    async for event in run.events():
        yield _event(event)
    keep(s, key, run)


def _event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


def _follow(s: Services, record: BackgroundResponse, starting_after: int) -> SSEResponse:
    """A background response's events after `starting_after`, then live; leaving does not stop it."""

    async def events() -> AsyncIterator[str]:
        async for event in record.replay(starting_after):
            yield _event(event)

    return SSEResponse(events(), lambda: None, s.config.sse_keepalive_s)


async def retrieve_response(request: Request) -> Response:
    s: Services = request.app.state.services
    record = s.background.get(api_key(request.headers), "responses", request.path_params["response_id"])
    query = request.query_params
    if query.get("stream", "false") not in ("true", "false"):
        raise ServiceError("invalid_request", f"stream must be true or false, got {query['stream']!r}", "stream")
    if query.get("stream") != "true":
        return JSONResponse(record.response())
    after = query.get("starting_after", "-1")
    try:
        return _follow(s, record, int(after))
    except ValueError:
        raise ServiceError(
            "invalid_request", f"starting_after must be an integer, got {after!r}", "starting_after"
        ) from None


async def cancel_response(request: Request) -> Response:
    """Aborts a background response and answers it as it ended (status `cancelled`, or how it had ended)."""
    s: Services = request.app.state.services
    record = s.background.cancel(api_key(request.headers), "responses", request.path_params["response_id"])
    async for _ in record.replay(len(record.events) - 1):
        pass
    return JSONResponse(record.response())


async def delete_response(request: Request) -> Response:
    s: Services = request.app.state.services
    response_id = request.path_params["response_id"]
    s.background.delete(api_key(request.headers), "responses", response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


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
        ("/v1/responses/{response_id}", retrieve_response, ["GET"]),
        ("/v1/responses/{response_id}", delete_response, ["DELETE"]),
        ("/v1/responses/{response_id}/cancel", cancel_response, ["POST"]),
    ]
