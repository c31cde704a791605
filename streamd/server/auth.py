"""API keys and the WebSocket Origin allowlist.

Keys come as `Authorization: Bearer <key>` on HTTP and WebSocket, or, for browsers (which cannot set
headers on a WebSocket), as a `bearer.<key>` entry in `Sec-WebSocket-Protocol`. Keys are compared in
constant time. An empty key list disables authentication.

Origins (what a browser says about the page that opened a WebSocket or sent a POST): a request without
one comes from a non-browser client and is allowed. With no allowlist, only pages served from a loopback
host (`localhost`, `127.0.0.0/8`, `::1`) or from this server itself (Origin host equal to Host) are
allowed, so a web page a local user visits cannot drive the server; same-origin counts only for a Host the
Host allowlist serves (`hosts.py`: DNS rebinding). `"*"` in the allowlist allows any.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Iterator, Mapping
from urllib.parse import urlsplit

from streamd.server.errors import ServiceError
from streamd.server.hosts import HostAllowlist, is_loopback

BEARER_SUBPROTOCOL_PREFIX = "bearer."


class Authenticator:
    def __init__(
        self, api_keys: Iterable[str], allowed_origins: Iterable[str], hosts: HostAllowlist | None = None
    ) -> None:
        self._keys = [k.encode() for k in api_keys]
        self._origins = {o.rstrip("/") for o in allowed_origins}
        self.hosts = hosts  # the Host allowlist (hosts.py); None: any Host

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
        return not self._keys or self.websocket_key(headers, subprotocols) is not None

    def websocket_key(self, headers: Mapping[str, str], subprotocols: Iterable[str]) -> str | None:
        """The caller's key on a WebSocket: the offered key (header first, then each `bearer.`
        subprotocol) that authenticated it, or with no keys configured the first one offered. What a
        connection's resumable requests and stored responses are bound to."""
        offered = _offered_keys(headers, subprotocols)
        return next((key for key in offered if self.key_ok(key)), None)

    def host_refusal(self, host: str | None) -> ServiceError | None:
        """Why a request with this Host header is not served (hosts.py: DNS rebinding); None: it is."""
        return None if self.hosts is None else self.hosts.refusal(host)

    def origin_ok(self, origin: str | None, host: str | None) -> bool:
        """A missing Origin is a non-browser client; browsers always send one. `host`: the Host header."""
        if origin is None or "*" in self._origins:
            return True
        if self._origins:
            return origin.rstrip("/") in self._origins
        try:
            netloc = urlsplit(origin).netloc
            hostname = urlsplit(origin).hostname
        except ValueError:
            return False
        return self._same_origin(netloc, host) or is_loopback(hostname)

    def _same_origin(self, netloc: str, host: str | None) -> bool:
        """An Origin equal to the Host, for a Host the allowlist serves (DNS rebinding: hosts.py)."""
        allowed = self.hosts is None or self.hosts.allows(host)
        return host is not None and netloc.lower() == host.lower() and allowed

    def describe_origin_policy(self) -> str:
        if "*" in self._origins:
            return "any Origin"
        if self._origins:
            return "Origins " + ", ".join(sorted(self._origins))
        return "loopback and same-origin pages only (set server.allowed_origins to allow others)"


def api_key(headers: Mapping[str, str]) -> str:
    """Whose a stored response is (the Responses store's and background responses' partition): the request's
    bearer token ("" when the server has no keys)."""
    return bearer_token(headers.get("authorization")) or ""


def bearer_token(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _offered_keys(headers: Mapping[str, str], subprotocols: Iterable[str]) -> Iterator[str]:
    """The keys a WebSocket handshake offers: the Authorization header's, then each `bearer.` subprotocol's."""
    key = bearer_token(headers.get("authorization"))
    if key:
        yield key
    yield from (p[len(BEARER_SUBPROTOCOL_PREFIX) :] for p in subprotocols if p.startswith(BEARER_SUBPROTOCOL_PREFIX))
