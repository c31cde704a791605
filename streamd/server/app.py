"""The Starlette app: routes, auth middleware, error rendering, and the lifespan that warms the engine.

`create_app(config, engine)` serves an already-built `EngineClient` (the caller owns its lifetime, so tests
can share one loaded model between apps). Routes are listed in docs/SERVER.md; every route but `/`,
`/static/...`, `/favicon.ico`, `/v1/server-info`, `/health` and `/ready` needs an API key when keys are
configured (`/` is a static page that holds no data and asks for the key itself; WebSocket auth happens in
the handshake, see ws.py). CORS (`OriginCors`) answers browsers' preflights from the origins
`server.allowed_origins` allows, before any key is asked for.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.utils import ClientDisconnected

from streamd import heap
from streamd.config import Config
from streamd.engine import EngineClient, SamplingParams
from streamd.logs import get_logger
from streamd.server.auth import Authenticator
from streamd.server.background import BackgroundResponses
from streamd.server.compile_gate import CompileGate
from streamd.server.errors import ServiceError, error_response, http_error
from streamd.server.generation import Generation, new_request_id
from streamd.server.hosts import HostAllowlist
from streamd.server.http import openai_routes, responses_api, tokenize_api
from streamd.server.http.guard import HttpGuard
from streamd.server.http.server_info import server_info_route
from streamd.server.lifecycle import Lifecycle
from streamd.server.logprobs import TokenTexts
from streamd.server.metrics import CONTENT_TYPE, Metrics
from streamd.server.model_names import ModelNames
from streamd.server.responses_store import ResponseStore
from streamd.server.services import Services
from streamd.server.tenants import Tenants
from streamd.server.tool_parsers import tool_format
from streamd.server.ws import responses as responses_ws
from streamd.server.ws import stream as ws
from streamd.server.ws.resume import ResumeStore

logger = get_logger(__name__)
STATIC = Path(__file__).parent / "static"
OPEN_PATHS = frozenset({"/", "/favicon.ico", "/v1/server-info", "/health", "/ready"})
OPEN_PREFIX = "/static/"  # the chat page's scripts, styles, icon and vendored libraries
# Why /ready answers 503 -> the code of its error body.
_NOT_READY = {
    "draining": "shutting_down",
    "warming_up": "service_unavailable",
    "engine_unavailable": "engine_unavailable",
}
# The chat page: its own scripts and styles (files only: no inline script, style element or style
# attribute), never framed, never sniffed.
# connect-src names ws: and wss: because older browsers do not match WebSocket URLs against 'self'.
PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; "
    "style-src 'self'; connect-src 'self' ws: wss:; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def create_app(config: Config, engine: EngineClient, *, warm_up: bool = True) -> Starlette:
    server = config.server
    tenants = Tenants(server)
    metrics = Metrics(engine, tenants.label)
    lifecycle = Lifecycle(engine, server.drain_timeout_s)
    services = Services(
        server,
        engine,
        ModelNames.of(server.served_model_name, config.model.name, engine.model_name),
        int(time.time()),
        Authenticator(
            server.api_keys,
            server.allowed_origins,
            HostAllowlist(server.allowed_hosts, server.host, bool(server.api_keys)),
        ),
        metrics,
        lifecycle,
        Generation(engine, server, lifecycle, metrics, CompileGate(config.grammar), tenants),
        ResponseStore(
            server.responses_store_size,
            server.responses_store_ttl_s,
            Path(server.responses_store_dir).expanduser() if server.responses_store_dir else None,
        ),
        TokenTexts(engine.tokenizer),
        tool_format(getattr(engine.tokenizer, "chat_template", None)),
        ResumeStore(
            server.resume_grace_s, server.resume_max_tokens_per_request, server.resume_max_tokens_total, metrics
        ),
        BackgroundResponses(server.max_background_responses, server.background_retention_s),
    )
    lifecycle.on_drain(services.resumes.end_detached)
    page = (STATIC / "index.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        logger.info("origin_policy", allowed=services.auth.describe_origin_policy())
        engine.start()
        task = asyncio.create_task(_warm_up(services)) if warm_up else None
        if task is None:
            lifecycle.warmed_up = True
        yield
        if task is not None:
            task.cancel()
        services.generation.tokenizing.close()

    async def index(request: Request) -> Response:
        return HTMLResponse(page, headers=PAGE_HEADERS)

    routes = [
        Route("/", index, methods=["GET"]),
        Route("/favicon.ico", favicon, methods=["GET"]),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
        Route("/v1/server-info", server_info_route, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
        WebSocketRoute("/v1/stream", ws.stream_endpoint),
        *(Route(path, fn, methods=methods) for path, fn, methods in openai_routes.make_routes()),
        *(Route(path, fn, methods=methods) for path, fn, methods in responses_api.make_routes()),
        *(Route(path, fn, methods=methods) for path, fn, methods in tokenize_api.make_routes()),
        WebSocketRoute("/v1/responses", responses_ws.responses_endpoint),  # same path: WebSocket mode
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={ServiceError: service_error, HTTPException: http_exception, Exception: internal_error},
    )
    app.state.services = services
    app.add_middleware(HttpGuard, auth=services.auth, max_body_bytes=server.max_body_bytes)
    app.add_middleware(AuthMiddleware, auth=services.auth)
    app.add_middleware(OriginCors, auth=services.auth)  # outermost: a preflight is answered before auth
    return app


async def favicon(request: Request) -> Response:
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")


async def health(request: Request) -> Response:
    engine: EngineClient = request.app.state.services.engine
    if engine.dead_reason is not None and not request.app.state.services.lifecycle.draining:
        error = ServiceError("engine_unavailable", f"the engine is dead: {engine.dead_reason}")
        return JSONResponse(
            {"status": "engine_dead", "reason": engine.dead_reason, **error.openai_body()}, status_code=503
        )
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    lifecycle: Lifecycle = request.app.state.services.lifecycle
    status = lifecycle.status
    if status == "ready":
        return JSONResponse({"status": status})
    error = ServiceError(_NOT_READY[status], f"not ready: {status.replace('_', ' ')}")
    return JSONResponse({"status": status, **error.openai_body()}, status_code=503)


async def metrics_route(request: Request) -> Response:
    return Response(request.app.state.services.metrics.render(), media_type=CONTENT_TYPE)


async def service_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ServiceError)
    return error_response(exc)


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (unknown route, wrong method) and any guard's HTTPException, as JSON."""
    assert isinstance(exc, HTTPException)
    where = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        message = f"no route {where}"
    elif exc.status_code == 405:
        message = f"{where}: method not allowed (allowed: {(exc.headers or {}).get('Allow', 'none')})"
    else:
        message = f"{where}: {exc.detail}"
    return error_response(http_error(exc.status_code, message), exc.status_code, exc.headers)


async def internal_error(request: Request, exc: Exception) -> Response:
    """Anything unhandled (also what a middleware raises): a ServiceError or HTTPException keeps its status,
    the rest is a 500; always a JSON error body."""
    if isinstance(exc, ServiceError):
        return await service_error(request, exc)
    if isinstance(exc, HTTPException):
        return await http_exception(request, exc)
    if isinstance(exc, (ClientDisconnect, ClientDisconnected)):  # nobody is left to answer: no traceback
        logger.info("client_gone", path=request.url.path, error=type(exc).__name__)
        return Response(status_code=499)
    logger.exception("unhandled_error", path=request.url.path)
    return error_response(ServiceError("internal_error", "internal server error"))


class AuthMiddleware:
    """Bearer API keys on HTTP routes (WebSocket handshakes are checked by ws.py, before accept)."""

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"  # a CORS preflight carries no credentials (OriginCors)
            and self.auth.enabled
            and path not in OPEN_PATHS
            and not path.startswith(OPEN_PREFIX)
        ):
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            if not self.auth.http_ok(headers):
                error = ServiceError("unauthorized", "a valid API key is required (Authorization: Bearer KEY)")
                response = error_response(error, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OriginCors(CORSMiddleware):
    """CORS for browser pages on other origins (HTTP; WebSocket handshakes keep ws.py's Origin check).

    The origins are the Authenticator's (`server.allowed_origins`, `"*"` any; none: loopback pages), so a page
    that may POST may also read the answer. A preflight (`OPTIONS` with `Access-Control-Request-Method`)
    carries no credentials, so it is answered here, before the API-key check; every answer to an allowed
    origin, a 401 included, names it in `Access-Control-Allow-Origin`, and exposes `Retry-After`.
    """

    def __init__(self, app: ASGIApp, auth: Authenticator) -> None:
        super().__init__(
            app,
            allow_methods=("GET", "POST", "DELETE"),
            allow_headers=("*",),  # Authorization, Content-Type and the SDKs' own (x-stainless-*)
            expose_headers=("Retry-After",),
        )
        self.auth = auth

    def is_allowed_origin(self, origin: str) -> bool:
        return self.auth.origin_ok(origin, None)


async def _warm_up(services: Services) -> None:
    """One tiny generation so the first user does not pay for lazy initialisation; then ready."""
    engine = services.engine
    try:
        ids = await services.generation.prompt_ids("Hello")
        stream = await engine.add_request(
            new_request_id(), None, SamplingParams(max_tokens=1, temperature=0.0), prompt_token_ids=ids
        )
        async for delta in stream:
            if delta.error:
                raise RuntimeError(delta.error)
        services.lifecycle.warmed_up = True
        heap.settle()  # the model and everything built so far are permanent: out of every collection
        logger.info("ready", model=services.model_name)
    except Exception:
        logger.exception("warm_up_failed")
