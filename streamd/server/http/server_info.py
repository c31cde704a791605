"""`GET /v1/server-info`: what the chat page needs before it can talk to the API.

Open without a key (like `/` and `/ready`), because the page must learn whether to ask for one. It says
whether a key is required and how the server stands; the model's name and context length go only to a
caller that may use the API (no keys configured, or a valid `Authorization: Bearer` key), as `/v1/models`
would give them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from streamd import __version__
from streamd.server.services import Services


@dataclass(slots=True, frozen=True)
class ServerInfo:
    auth_required: bool
    status: str  # as /ready: ready, warming_up, draining, engine_unavailable
    version: str
    model: str | None  # None unless the caller may use the API
    max_model_len: int | None


def server_info(services: Services, headers: Mapping[str, str]) -> ServerInfo:
    allowed = services.auth.http_ok(headers)
    return ServerInfo(
        auth_required=services.auth.enabled,
        status=services.lifecycle.status,
        version=__version__,
        model=services.model_name if allowed else None,
        max_model_len=services.engine.max_model_len if allowed else None,
    )


async def server_info_route(request: Request) -> Response:
    info = server_info(request.app.state.services, request.headers)
    return JSONResponse({"object": "server_info", **asdict(info)}, headers={"Cache-Control": "no-store"})
