"""The Starlette app: routes, auth middleware, error rendering, and the lifespan that warms the engine.

`create_app(config, engine)` serves an already-built `AsyncEngine` (the caller owns its lifetime, so tests
can share one loaded model between apps). Routes are listed in ARCHITECTURE.md; every route but `/`,
`/health` and `/ready` needs an API key when keys are configured (`/` is a static page that holds no data
and asks for the key itself; WebSocket auth happens in the handshake, see ws.py).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.types import ASGIApp, Receive, Scope, Send

from streamd import heap
from streamd.config import Config
from streamd.engine.async_engine import AsyncEngine
from streamd.engine.sampling_params import SamplingParams
from streamd.logs import get_logger
from streamd.server import openai_routes, responses_api, responses_ws, ws
from streamd.server.auth import Authenticator
from streamd.server.errors import ServiceError
from streamd.server.generation import Generation, new_request_id
from streamd.server.lifecycle import Lifecycle
from streamd.server.metrics import CONTENT_TYPE, Metrics
from streamd.server.responses_store import ResponseStore
from streamd.server.services import Services

logger = get_logger(__name__)
STATIC = Path(__file__).parent / "static"
OPEN_PATHS = frozenset({"/", "/health", "/ready"})


def create_app(config: Config, engine: AsyncEngine, *, warm_up: bool = True) -> Starlette:
    server = config.server
    metrics = Metrics(engine)
    lifecycle = Lifecycle(engine, server.drain_timeout_s)
    services = Services(server, engine, server.served_model_name or engine.model_name, int(time.time()),
                        Authenticator(server.api_keys, server.allowed_origins), metrics, lifecycle,
                        Generation(engine, server, lifecycle, metrics),
                        ResponseStore(server.responses_store_size, server.responses_store_ttl_s))
    page = (STATIC / "index.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        task = asyncio.create_task(_warm_up(services)) if warm_up else None
        if task is None:
            lifecycle.warmed_up = True
        yield
        if task is not None:
            task.cancel()

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        WebSocketRoute("/v1/stream", ws.stream_endpoint),
        *(Route(path, fn, methods=methods) for path, fn, methods in openai_routes.make_routes()),
        *(Route(path, fn, methods=methods) for path, fn, methods in responses_api.make_routes()),
        WebSocketRoute("/v1/responses", responses_ws.responses_endpoint),  # same path: WebSocket mode
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={ServiceError: service_error, Exception: internal_error})
    app.state.services = services
    app.add_middleware(AuthMiddleware, auth=services.auth)
    return app


async def health(request: Request) -> Response:
    engine: AsyncEngine = request.app.state.services.engine
    if engine.dead_reason is not None and not request.app.state.services.lifecycle.draining:
        return JSONResponse({"status": "engine_dead", "reason": engine.dead_reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    lifecycle: Lifecycle = request.app.state.services.lifecycle
    if lifecycle.ready:
        return JSONResponse({"status": "ready"})
    status = "draining" if lifecycle.draining else "warming_up" if not lifecycle.warmed_up else "engine_unavailable"
    return JSONResponse({"status": status}, status_code=503)


async def metrics_route(request: Request) -> Response:
    return Response(request.app.state.services.metrics.render(), media_type=CONTENT_TYPE)


async def service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return JSONResponse(exc.openai_body(), status_code=exc.status)


async def internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled_error", path=request.url.path)
    return JSONResponse(ServiceError("internal_error", "internal server error").openai_body(), status_code=500)


class AuthMiddleware:
    """Bearer API keys on HTTP routes (WebSocket handshakes are checked by ws.py, before accept)."""

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.auth.enabled and scope["path"] not in OPEN_PATHS:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            if not self.auth.http_ok(headers):
                error = ServiceError("unauthorized", "a valid API key is required (Authorization: Bearer KEY)")
                response = JSONResponse(error.openai_body(), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _warm_up(services: Services) -> None:
    """One tiny generation so the first user does not pay for lazy initialisation; then ready."""
    engine = services.engine
    try:
        ids = services.generation.prompt_ids("Hello")
        stream = await engine.add_request(new_request_id(), None, SamplingParams(max_tokens=1, temperature=0.0),
                                          prompt_token_ids=ids)
        async for delta in stream:
            if delta.error:
                raise RuntimeError(delta.error)
        services.lifecycle.warmed_up = True
        heap.settle()  # the model and everything built so far are permanent: out of every collection
        logger.info("ready", model=services.model_name)
    except Exception:
        logger.exception("warm_up_failed")
