"""API keys and the WebSocket Origin allowlist.

Keys come as `Authorization: Bearer <key>` on HTTP and WebSocket, or, for browsers (which cannot set
headers on a WebSocket), as a `bearer.<key>` entry in `Sec-WebSocket-Protocol`. Keys are compared in
constant time. An empty key list disables authentication; an empty origin list allows any Origin.
"""

from __future__ import annotations

import hmac
from typing import Iterable, Mapping

BEARER_SUBPROTOCOL_PREFIX = "bearer."


class Authenticator:
    def __init__(self, api_keys: Iterable[str], allowed_origins: Iterable[str]) -> None:
        self._keys = [k.encode() for k in api_keys]
        self._origins = {o.rstrip("/") for o in allowed_origins}

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def key_ok(self, key: str | None) -> bool:
        if not self._keys:
            return True
        if not key:
            return False
        given = key.encode()
        # Check every key so timing does not reveal which one matched.
        return sum(hmac.compare_digest(given, k) for k in self._keys) > 0

    def http_ok(self, headers: Mapping[str, str]) -> bool:
        return self.key_ok(bearer_token(headers.get("authorization")))

    def websocket_ok(self, headers: Mapping[str, str], subprotocols: Iterable[str]) -> bool:
        if not self._keys:
            return True
        if self.key_ok(bearer_token(headers.get("authorization"))):
            return True
        return any(self.key_ok(p[len(BEARER_SUBPROTOCOL_PREFIX):]) for p in subprotocols
                   if p.startswith(BEARER_SUBPROTOCOL_PREFIX))

    def origin_ok(self, origin: str | None) -> bool:
        """A missing Origin is a non-browser client; browsers always send one."""
        if not self._origins or origin is None or "*" in self._origins:
            return True
        return origin.rstrip("/") in self._origins


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def presented_key(headers: Mapping[str, str], subprotocols: Iterable[str]) -> str | None:
    """The API key a WebSocket handshake presented (header first, then a `bearer.` subprotocol)."""
    key = bearer_token(headers.get("authorization"))
    if key:
        return key
    return next((p[len(BEARER_SUBPROTOCOL_PREFIX):] for p in subprotocols if p.startswith(BEARER_SUBPROTOCOL_PREFIX)),
                None)
