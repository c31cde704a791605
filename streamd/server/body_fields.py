"""Checks of the request-body fields every OpenAI-style request shares (`model`, boolean flags).

Both wings read such bodies: the HTTP routes and the Responses API's WebSocket mode (whose `response.create`
carries the fields of `POST /v1/responses`). Their own module so that neither wing imports the other.
"""

from __future__ import annotations

from typing import Any

from streamd.server.errors import ServiceError
from streamd.server.services import Services


def body_flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field of a body (`default` when absent or null); anything else is refused, naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ServiceError("invalid_request", f"{name} must be a boolean, got {value!r}", name)
    return value


def check_model(s: Services, body: dict[str, Any]) -> None:
    """Refuses a `model` this server does not serve (absent: the one it serves)."""
    s.models.check(body.get("model"))
