"""Who a request is, for the engine's fair share and the per-tenant metrics: never the raw API key.

The tenant is the request's API key (`server.tenant_from = "key"`), or its `user` / `safety_identifier` field
(`"user"`: a deployment with keys off whose frontend names its users), or nobody (`"none"`: one tenant);
`"auto"` takes the key where keys are on, else the user field. `server.tenants` gives keys (or user values)
names ("name=value" entries): the engine sees that name, metrics label by it. Any other key or user is a
stable digest in the engine ("key-…", "user-…", so equal values share a fair share without the value ever
reaching the engine) and "other" in metrics (a client cannot grow the label set).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from streamd.config import ServerConfig
from streamd.engine import DEFAULT_TENANT, add_tallies

if TYPE_CHECKING:
    from streamd.engine import TenantStats

OTHER_LABEL = "other"  # the metrics label of every tenant without a configured name (DEFAULT_TENANT has its own)


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str  # what the engine schedules by
    label: str  # what metrics show


class Tenants:
    def __init__(self, config: ServerConfig) -> None:
        self._from = config.tenant_from
        if self._from == "auto":
            self._from = "key" if config.api_keys else "user"
        self._names = config.tenant_map()
        self.labels = frozenset({*self._names.values(), DEFAULT_TENANT})

    def of(self, api_key: str | None, user: str | None = None) -> Tenant:
        """The tenant of a request made with `api_key` by `user` (the body's, `generation.wire_user`)."""
        value, kind = self._identity(api_key, user)
        if not value:  # (no key: None, or "" as `auth.api_key` has it)
            return Tenant(DEFAULT_TENANT, DEFAULT_TENANT)
        name = self._names.get(value)
        if name is not None:
            return Tenant(name, name)
        return Tenant(f"{kind}-{hashlib.sha256(value.encode()).hexdigest()[:16]}", OTHER_LABEL)

    def _identity(self, api_key: str | None, user: str | None) -> tuple[str | None, str]:
        if self._from == "key":
            return api_key, "key"
        if self._from == "user":
            return user, "user"
        return None, "none"

    def label(self, name: str) -> str:
        """The metrics label of an engine tenant name."""
        return name if name in self.labels else OTHER_LABEL


@dataclass(slots=True)
class TenantTotals:
    """What the engine served one metrics label (every unnamed tenant summed under "other")."""

    tenant: str  # the label
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    admissions: int = 0
    queue_seconds: float = 0.0


def tenant_totals(tenants: list[TenantStats], label: Callable[[str], str]) -> list[TenantTotals]:
    """The engine's per-tenant stats summed per label (`Tenants.label`), most served first: what /metrics and
    the engine view's `tenants` rows show."""
    totals: dict[str, TenantTotals] = {}
    for tenant in tenants:
        name = label(tenant.name)
        row = totals.get(name)
        if row is None:
            row = totals[name] = TenantTotals(name)
        add_tallies(row, tenant)
    return sorted(totals.values(), key=lambda row: -(row.prompt_tokens + row.output_tokens))
