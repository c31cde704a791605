"""FairShare: the order in which the scheduler serves many tenants, and which of them gives way first.

streamd was strictly first come, first served: one client that opens 200 streams made every other user wait
behind them. Here every tenant (an API key's name, or a stable digest: never the raw key; `tenant` on the
request's SamplingParams) has a virtual token counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI '24): the tokens the engine computed for it, a prompt token weighing `PROMPT_WEIGHT` and an
output token `OUTPUT_WEIGHT`, divided by the tenant's configured weight (`scheduler.tenant_weights`). A tenant
that becomes active (a request while it had none queued) is lifted to the least counter of the active ones,
so idle time banks no credit.

Order (`key`, ascending: first admitted, last preempted): the service tier (`priority` < `default` < `flex`),
then the request's `priority` (vLLM's: lower first), then the tenant's counter, then arrival. Waiting
groups are ordered with the expected cost of a tenant's earlier waiting groups already charged (prompt and
`max_tokens`: `waiting_order`), so one step's admissions interleave tenants as the counter would one by one
(an estimate for the order only: the counters charge the tokens actually computed). With one
tenant and no tiers the order is arrival order: `fcfs` and `fair` schedule alike. Plain Python, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from streamd.engine.core.scheduler_output import ScheduledSeq
from streamd.engine.core.sequence import SequenceGroup
from streamd.engine.stats import TenantStats

PROMPT_WEIGHT = 1.0  # the paper's w_p
OUTPUT_WEIGHT = 2.0  # the paper's w_q: an output token costs a step of its own
MAX_TENANTS = 1024  # tenants remembered; past it the idle ones least served are forgotten (keys off: `user`)
STATS_TENANTS = 16  # tenants reported one by one in the stats (most served first); the rest as OTHER
OTHER = "other"
# A waiting request passed over (it did not fit) for longer than this, or half its queue timeout, stops the
# admission of those after it in the order, so memory freed is kept for it: nobody starves behind others.
STARVING_S = 10.0
TIERS = {"priority": 0, "auto": 1, "default": 1, "flex": 2}
FLEX = TIERS["flex"]
DEFAULT_TIER = TIERS["default"]


def starving(group: SequenceGroup, now: float) -> bool:
    """Whether `group` has waited so long that admission must stop behind it (`STARVING_S`)."""
    timeout = group.sampling_params.queue_timeout_s
    limit = STARVING_S if timeout is None else min(STARVING_S, timeout / 2)
    return now - group.arrival_time > limit


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


@dataclass(slots=True)
class FairShare:
    """Per-tenant counters and the orders built from them (`fair`); with `fair` False every tenant's
    counter is left out of the order (first come, first served within a tier)."""

    fair: bool = True
    weights: Mapping[str, float] = field(default_factory=dict)
    tenants: dict[str, Tenant] = field(default_factory=dict)
    _tiered: int = 0  # active groups outside the default tier or with a priority

    def arrive(self, group: SequenceGroup) -> None:
        """A group entered the queues: its tenant, newly active, is lifted to the least active counter."""
        tenant = self._tenant(group.sampling_params.tenant)
        if tenant.active == 0:
            counters = [t.counter for t in self.tenants.values() if t.active]
            tenant.counter = max(tenant.counter, min(counters, default=tenant.counter))
        tenant.active += 1
        self._tiered += _tiered(group)

    def leave(self, group: SequenceGroup) -> None:
        self.tenants[group.sampling_params.tenant].active -= 1
        self._tiered -= _tiered(group)
        if len(self.tenants) > MAX_TENANTS:
            self._forget_idle()

    def _forget_idle(self) -> None:
        """Drops the idle tenants least served (a returning one starts at the least active counter, as
        it would have been lifted to) down to half of MAX_TENANTS."""
        idle = sorted((t.counter, name) for name, t in self.tenants.items() if not t.active)
        for _, name in idle[: len(self.tenants) - MAX_TENANTS // 2]:
            del self.tenants[name]

    def charge(self, scheduled: Iterable[ScheduledSeq]) -> None:
        """The step's tokens to their tenants' counters: a chunk's tokens as prompt (a recompute's too), each
        token the step samples as output."""
        tenants = self.tenants
        for item in scheduled:
            tenant, seq, cost = tenants[item.group.sampling_params.tenant], item.seq, 0.0
            if item.num_new_tokens > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:
                tenant.prompt_tokens += item.num_new_tokens
                cost = PROMPT_WEIGHT * item.num_new_tokens
            if item.samples:
                tenant.output_tokens += 1
                cost += OUTPUT_WEIGHT
            tenant.counter += cost / tenant.weight

    def preempted(self, group: SequenceGroup) -> None:
        self.tenants[group.sampling_params.tenant].preemptions += 1

    @property
    def reorders(self) -> bool:
        """Whether the order can differ from arrival order (several active tenants, or tiers)."""
        return self._tiered > 0 or (self.fair and sum(1 for t in self.tenants.values() if t.active) > 1)

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
            tenant = group.sampling_params.tenant
            charged = pending.get(tenant, 0.0)
            keyed.append((self.key(group, rank[group.request_id], charged), group))
            cost = _expected_cost(group) / self.tenants[tenant].weight
            pending[tenant] = charged + cost
        keyed.sort(key=lambda pair: pair[0])
        return [group for _, group in keyed]

    def _tenant(self, name: str) -> Tenant:
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(self.weights.get(name, 1.0))
        return tenant

    def stats(self) -> list[TenantStats]:
        """The STATS_TENANTS most served tenants, the rest summed as OTHER (a bounded snapshot per step)."""
        ranked = sorted(self.tenants.items(), key=lambda item: -item[1].counter)
        shown = [TenantStats(n, t.prompt_tokens, t.output_tokens, t.preemptions, t.counter) for n, t in ranked]
        if len(shown) <= STATS_TENANTS:
            return shown
        rest = shown[STATS_TENANTS - 1 :]
        other = TenantStats(
            OTHER,
            sum(r.prompt_tokens for r in rest),
            sum(r.output_tokens for r in rest),
            sum(r.preemptions for r in rest),
            max(r.virtual_tokens for r in rest),
        )
        return [*shown[: STATS_TENANTS - 1], other]


def _tiered(group: SequenceGroup) -> int:
    params = group.sampling_params
    return int(TIERS[params.service_tier] != DEFAULT_TIER or params.priority != 0)


def _expected_cost(group: SequenceGroup) -> float:
    """A waiting group's weighted tokens if it runs to its `max_tokens`."""
    params = group.sampling_params
    return PROMPT_WEIGHT * len(group.prompt_token_ids) + OUTPUT_WEIGHT * (params.max_tokens or 0) * params.n
