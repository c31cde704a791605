"""The Host allowlist: the DNS-rebinding defence of a server without API keys.

A page on `attacker.example` can make its name resolve to 127.0.0.1 (DNS rebinding); the browser then
sends the page's requests to this server as same-origin ones, `Host: attacker.example:PORT` and an Origin
to match. So without API keys only these Host names are served: loopback names (`localhost`, `*.localhost`,
`127.0.0.0/8`, `::1`), the bound host when it is a name or address (not `0.0.0.0` / `::`), and
`server.allowed_hosts` (`"*"`: any, as behind a proxy that checks names itself). Another Host gets 400 on
HTTP and a refused WebSocket handshake, naming it. With API keys any Host is served: a page cannot present
a key it does not have. The Origin policy's same-origin rule (auth.py) trusts only a Host this allows.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from urllib.parse import urlsplit

from streamd.server.errors import ServiceError

_ANY_ADDRESS = frozenset({"", "0.0.0.0", "::", "[::]"})


class HostAllowlist:
    def __init__(self, allowed_hosts: Iterable[str], bound_host: str, keys_set: bool) -> None:
        names = {h.lower().strip("[]") for h in allowed_hosts}
        if bound_host not in _ANY_ADDRESS:
            names.add(bound_host.lower().strip("[]"))
        self._names = frozenset(names)
        self._any = keys_set or "*" in names

    def allows(self, host: str | None) -> bool:
        """Whether a request with this Host header is served (a missing one: a non-browser client)."""
        if host is None or self._any:
            return True
        name = _hostname(host)
        return name is not None and (name in self._names or is_loopback(name))

    def refusal(self, host: str | None) -> ServiceError | None:
        if self.allows(host):
            return None
        return ServiceError(
            "invalid_host",
            f"the Host {host!r} is not served here: without API keys this server answers only loopback names, "
            "its bound host and server.allowed_hosts",
        )


def _hostname(host: str) -> str | None:
    try:
        return urlsplit(f"//{host}").hostname
    except ValueError:
        return None


def is_loopback(hostname: str | None) -> bool:
    if not hostname:
        return False
    if hostname == "localhost" or hostname.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(hostname).is_loopback
    except ValueError:
        return False
