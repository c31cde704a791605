"""FairShare: the order in which the scheduler serves many tenants, and which of them gives way first.

streamd was strictly first come, first served: one client that opens 200 streams made every other user wait
behind them. Here every tenant (an API key's name, or a stable digest: never the raw key; `tenant` on the
request's SamplingParams) has a virtual token counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI '24): the tokens the engine computed for it, a prompt token weighing `PROMPT_WEIGHT` and an
output token `OUTPUT_WEIGHT`, divided by the tenant's configured weight (`scheduler.tenant_weights`). A tenant
that becomes active (a request while it had none queued) is lifted to the least counter of the active ones,
so idle time banks no credit.

Order (`key`, ascending: first admitted, last preempted): the service tier (`priority` < `default` < `flex`),
then the request's `priority` (vLLM's: lower first), then the tenant's counter, then arrival; ahead of all that,
a waiting request that has `aged` (waited past a fraction of its queue timeout, so it is near the deadline by
which it must be scheduled), oldest first (the scheduler's `_aged_first`). Waiting
groups are ordered with the expected cost of a tenant's earlier waiting groups already charged (prompt and
`max_tokens`: `waiting_order`), so one step's admissions interleave tenants as the counter would one by one
(an estimate for the order only: the counters charge the tokens actually computed). With one
tenant and no tiers the order is arrival order: `fcfs` and `fair` schedule alike. Plain Python, no torch.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from streamd.engine.core.scheduler_output import ScheduledSeq
from streamd.engine.core.sequence import SequenceGroup
from streamd.engine.stats import TENANT_TALLIES, TenantStats, add_tallies

PROMPT_WEIGHT = 1.0  # the paper's w_p
OUTPUT_WEIGHT = 2.0  # the paper's w_q: an output token costs a step of its own
MAX_TENANTS = 1024  # tenants remembered; past it the idle unnamed ones least served are forgotten (keys off: `user`)
STATS_TENANTS = 16  # unnamed tenants reported one by one in the stats (most served first); the rest as OTHER
OTHER = "other"
# A waiting request passed over (it did not fit) for longer than this, or the aging fraction of its queue timeout,
# stops the admission of those after it in the order, so memory freed is kept for it: nobody starves behind others.
STARVING_S = 10.0
TIERS = {"priority": 0, "auto": 1, "default": 1, "flex": 2}
FLEX = TIERS["flex"]
DEFAULT_TIER = TIERS["default"]


def starving(group: SequenceGroup, now: float, aging: float) -> bool:
    """Whether `group` has waited so long that admission must stop behind it (`STARVING_S`, or the `aging`
    fraction of its queue timeout if sooner)."""
    timeout = group.sampling_params.queue_timeout_s
    limit = STARVING_S if timeout is None else min(STARVING_S, timeout * aging)
    return now - group.arrival_time > limit


def aged(group: SequenceGroup, now: float, aging: float) -> bool:
    """Whether `group`, never scheduled yet, has waited past the `aging` fraction of its queue timeout
    (`scheduler.queue_aging` of `server.max_queue_time_s`): it then goes ahead of every tier and fair share,
    oldest first, so a seat that frees before its deadline is its. Without a queue timeout nothing ages (the
    tiers hold: `flex` may wait indefinitely behind a sustained `priority` load)."""
    timeout = group.sampling_params.queue_timeout_s
    return timeout is not None and group.first_scheduled_time is None and now - group.arrival_time >= timeout * aging


def tier_of(group: SequenceGroup) -> int:
    return TIERS[group.sampling_params.service_tier]


@dataclass(slots=True)
class Tenant:
    """One tenant's counter and tallies."""

    weight: float = 1.0
    counter: float = 0.0  # virtual tokens served (weighted, over the weight)
    active: int = 0  # its groups in the scheduler's queues
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    admissions: int = 0
    queue_seconds: float = 0.0


@dataclass(slots=True)
class FairShare:
    """Per-tenant counters and the orders built from them (`fair`); with `fair` False every tenant's
    counter is left out of the order (first come, first served within a tier). Every step reads it
    (`reorders`, `charge`, `stats`): those cost O(active tenants), not O(tenants remembered), and one tenant
    charges its decodes at once."""

    fair: bool = True
    weights: Mapping[str, float] = field(default_factory=dict)
    # Tenants always reported one by one and never forgotten (the server's metrics labels: `server.tenants` names
    # and DEFAULT_TENANT), so their counts never move into OTHER: a label's counters only grow.
    named: frozenset[str] = frozenset()
    tenants: dict[str, Tenant] = field(default_factory=dict)
    _active: dict[str, Tenant] = field(default_factory=dict)  # the tenants with `active` groups (an index)
    _tiered: int = 0  # active groups outside the default tier or with a priority
    _expected: dict[str, float] = field(default_factory=dict)  # request id -> `_expected_cost` over its weight
    _idle_stats: tuple[list[TenantStats], TenantStats | None] | None = None  # `_idle_rows`'s cache; None: stale
    _forgotten: Tenant = field(default_factory=Tenant)  # the forgotten tenants' tallies, kept in OTHER

    def arrive(self, group: SequenceGroup) -> None:
        """A group entered the queues: its tenant, newly active, is lifted to the least active counter."""
        name = group.sampling_params.tenant
        tenant = self._tenant(name)
        if tenant.active == 0:
            counters = [t.counter for t in self._active.values()]
            tenant.counter = max(tenant.counter, min(counters, default=tenant.counter))
            self._active[name] = tenant
            self._idle_stats = None
        tenant.active += 1
        self._tiered += _tiered(group)
        self._expected[group.request_id] = _expected_cost(group) / tenant.weight

    def leave(self, group: SequenceGroup) -> None:
        name = group.sampling_params.tenant
        tenant = self.tenants[name]
        tenant.active -= 1
        if tenant.active == 0:
            del self._active[name]
            self._idle_stats = None
        self._tiered -= _tiered(group)
        del self._expected[group.request_id]
        if len(self.tenants) > MAX_TENANTS:
            self._forget_idle()

    def _forget_idle(self) -> None:
        """Drops the idle unnamed tenants least served (a returning one starts at the least active counter, as
        it would have been lifted to) down to half of MAX_TENANTS; their tallies stay in OTHER."""
        idle = sorted((t.counter, name) for name, t in self.tenants.items() if not t.active and name not in self.named)
        gone = self._forgotten
        for _, name in idle[: len(self.tenants) - MAX_TENANTS // 2]:
            tenant = self.tenants.pop(name)
            add_tallies(gone, tenant)
            gone.counter = max(gone.counter, tenant.counter)
        self._idle_stats = None

    def charge(self, prefills: list[ScheduledSeq], decodes: list[ScheduledSeq]) -> None:
        """The step's tokens to their tenants' counters: a prompt chunk's tokens as prompt (a recompute's too)
        and its token if it samples as output; a decode's token as output. One active tenant takes all the
        decodes at once (no loop over the batch)."""
        tenants = self.tenants
        for item in prefills:
            tenant = tenants[item.group.sampling_params.tenant]
            tenant.prompt_tokens += item.num_new_tokens
            tenant.counter += PROMPT_WEIGHT * item.num_new_tokens / tenant.weight
            if item.samples:
                self._charge_output(tenant, 1)
        if len(self._active) == 1:
            if decodes:
                self._charge_output(next(iter(self._active.values())), len(decodes))
            return
        for name, count in Counter(item.group.sampling_params.tenant for item in decodes).items():
            self._charge_output(tenants[name], count)

    def charge_output(self, name: str, count: int) -> None:
        """`count` more output tokens of tenant `name` (a speculative step's accepted drafts)."""
        self._charge_output(self.tenants[name], count)

    @staticmethod
    def _charge_output(tenant: Tenant, count: int) -> None:
        tenant.output_tokens += count
        tenant.counter += OUTPUT_WEIGHT * count / tenant.weight

    def unserved(self, served: Container[str]) -> set[str]:
        """The active tenants not in `served` (O(active tenants))."""
        return {name for name in self._active if name not in served}

    def queued_beyond(self, name: str, seats: int, max_seats: int) -> bool:
        """Whether tenant `name`, running `seats` groups, holds fewer than its equal share of `max_seats` and
        has more groups queued than running (one waits)."""
        return seats * len(self._active) < max_seats and self.tenants[name].active > seats

    def interactive(self, name: str, max_seats: int) -> bool:
        """Whether tenant `name` has no more groups queued and running than its equal share of `max_seats` (a
        chat, not a backlog)."""
        return self.tenants[name].active * len(self._active) <= max_seats

    def least_served(self) -> str | None:
        """The active tenant with the least counter when the fair share orders several, of those tied the one
        with the fewest queued groups (a tenant that just became active is lifted to a tie); None otherwise.
        O(active tenants)."""
        if not self.fair or len(self._active) < 2:
            return None
        return min(self._active.items(), key=lambda item: (item[1].counter, item[1].active))[0]

    def preempted(self, group: SequenceGroup) -> None:
        self.tenants[group.sampling_params.tenant].preemptions += 1

    def admitted(self, group: SequenceGroup, waited_s: float) -> None:
        """`group` was scheduled for the first time, `waited_s` after it arrived."""
        tenant = self.tenants[group.sampling_params.tenant]
        tenant.admissions += 1
        tenant.queue_seconds += waited_s

    @property
    def reorders(self) -> bool:
        """Whether the order can differ from arrival order (several active tenants, or tiers)."""
        return self._tiered > 0 or (self.fair and len(self._active) > 1)

    def key(self, group: SequenceGroup, rank: int, charged: float = 0.0) -> tuple[int, int, float, int]:
        """Ascending: admitted first, preempted last."""
        params = group.sampling_params
        counter = self.tenants[params.tenant].counter + charged if self.fair else 0.0
        return TIERS[params.service_tier], params.priority, counter, rank

    def waiting_order(self, groups: Iterable[SequenceGroup], rank: Mapping[str, int]) -> list[SequenceGroup]:
        """`groups` (in arrival order) ordered for admission, each tenant's earlier waiting prompts charged."""
        pending: dict[str, float] = {}
        keyed = []
        for group in groups:
            tenant, rid = group.sampling_params.tenant, group.request_id
            charged = pending.get(tenant, 0.0)
            keyed.append((*self.key(group, rank[rid], charged), group))
            pending[tenant] = charged + self._expected[rid]
        keyed.sort()  # (the ranks differ: two groups are never compared)
        return [item[-1] for item in keyed]

    def _tenant(self, name: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(self.weights.get(name, 1.0))
        return tenant

    def stats(self) -> list[TenantStats]:
        """The `named` tenants seen, then the STATS_TENANTS most served others, the rest (and the forgotten)
        summed as OTHER (a bounded snapshot per step; each named row and the unnamed rows' sum only grow). Only
        the active tenants' counts change, so the idle ones are ranked once per change of the idle set."""
        named = [_row((name, self.tenants[name])) for name in self.named if name in self.tenants]
        idle, idle_rest = self._idle_rows()
        active = (item for item in self._active.items() if item[0] not in self.named)
        rows = sorted([*map(_row, active), *idle], key=_most_served)
        forgotten = [_row((OTHER, self._forgotten))] if self._forgotten != Tenant() else []
        if idle_rest is None and len(rows) <= STATS_TENANTS and not forgotten:
            return [*named, *rows]
        rest = rows[STATS_TENANTS - 1 :] + ([idle_rest] if idle_rest is not None else []) + forgotten
        return [*named, *rows[: STATS_TENANTS - 1], _summed(rest)]

    def _idle_rows(self) -> tuple[list[TenantStats], TenantStats | None]:
        """The idle unnamed tenants' STATS_TENANTS most served rows and the rest summed (None: none), cached."""
        if self._idle_stats is None:
            items = (item for item in self.tenants.items() if not item[1].active and item[0] not in self.named)
            idle = sorted(map(_row, items), key=_most_served)
            rest = idle[STATS_TENANTS:]
            self._idle_stats = idle[:STATS_TENANTS], _summed(rest) if rest else None
        return self._idle_stats


def _row(item: tuple[str, Tenant]) -> TenantStats:
    name, t = item
    return TenantStats(name, virtual_tokens=t.counter, **{key: getattr(t, key) for key in TENANT_TALLIES})


def _most_served(row: TenantStats) -> float:
    return -row.virtual_tokens


def _summed(rows: list[TenantStats]) -> TenantStats:
    """`rows` as one OTHER row: their tallies summed, the highest counter."""
    tallies = {key: sum(getattr(r, key) for r in rows) for key in TENANT_TALLIES}
    return TenantStats(OTHER, virtual_tokens=max(r.virtual_tokens for r in rows), **tallies)


def _tiered(group: SequenceGroup) -> int:
    params = group.sampling_params
    return int(TIERS[params.service_tier] != DEFAULT_TIER or params.priority != 0)


def _expected_cost(group: SequenceGroup) -> float:
    """A waiting group's weighted tokens if it runs to its `max_tokens`."""
    params = group.sampling_params
    return PROMPT_WEIGHT * len(group.prompt_token_ids) + OUTPUT_WEIGHT * (params.max_tokens or 0) * params.n
