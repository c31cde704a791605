"""HTTP request guard (an ASGI middleware): what may reach a route handler at all.

- a request whose Host the Host allowlist does not serve (hosts.py: DNS rebinding) gets 400, whatever its
  method, except the liveness probes `/health` and `/ready` (they say only whether the server is up, and
  orchestrators probe them by a pod's address);
- a browser request (it carries an Origin) from an Origin the policy refuses (auth.py) gets 403, so a
  page a local user visits cannot drive the server with a cross-origin "simple" POST;
- a POST that declares a Content-Type other than `application/json` gets 415 (text/plain and form bodies
  are how a cross-origin "simple" POST dodges the browser's preflight); one without a Content-Type comes
  from a non-browser client and is read as JSON;
- a body over `server.max_body_bytes` gets 413: refused from its Content-Length when given, otherwise
  counted chunk by chunk as it arrives, never parsed or held beyond the limit.

A body within limits is read here and handed to the route as one message.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from streamd.server.auth import Authenticator
from streamd.server.errors import ServiceError, error_response

PROBE_PATHS = frozenset({"/health", "/ready"})  # served whatever the Host (no secret, no side effect)


class HttpGuard:
    def __init__(self, app: ASGIApp, auth: Authenticator, max_body_bytes: int) -> None:
        self.app = app
        self.auth = auth
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        error = self._refusal(scope["method"], scope["path"], headers)
        if error is None and scope["method"] == "POST":
            body, error = await self._read_body(receive)
            if error is None:
                receive = _replay(body, receive)
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refusal(self, method: str, path: str, headers: Headers) -> ServiceError | None:
        host_refusal = None if path in PROBE_PATHS else self.auth.host_refusal(headers.get("host"))
        if host_refusal is not None or method != "POST":
            return host_refusal
        if not self.auth.origin_ok(headers.get("origin"), headers.get("host")):
            return ServiceError("forbidden_origin", "this Origin is not allowed (server.allowed_origins)")
        media_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media_type not in ("", "application/json"):
            return ServiceError(
                "unsupported_media_type",
                f"the request body must be JSON (Content-Type: application/json), got {media_type!r}",
            )
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    async def _read_body(self, receive: Receive) -> tuple[bytes, ServiceError | None]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"", ServiceError("invalid_request", "the client left before sending its body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", self._too_large()
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _too_large(self) -> ServiceError:
        return ServiceError(
            "request_too_large", f"the request body is larger than {self.max_body_bytes} bytes (server.max_body_bytes)"
        )


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body read already, then whatever the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
