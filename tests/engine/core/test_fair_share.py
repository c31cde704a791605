"""Fair share per tenant, service tiers and priorities (engine/core/fairness.py through the Scheduler), and
the prefix cache's per-tenant roots, driven by test_scheduler's model-free engine (its shadow KV cache
fails any lost or misplaced KV, so reordering and preemption must still reproduce every output)."""

from __future__ import annotations

import random
import zlib

import pytest

from streamd.config import SchedulerConfig
from streamd.engine.core.fairness import OTHER, OUTPUT_WEIGHT, PROMPT_WEIGHT, STARVING_S, STATS_TENANTS
from streamd.engine.core.prefix_cache import ROOT_HASH, prefix_root
from streamd.engine.core.scheduler import CATCH_UP_HOLD_STEPS, Scheduler
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.sampling_params import SamplingParams
from tests.engine.core.test_scheduler import CHEAP_SWAP, FakeEngine, reference


class TenantEngine(FakeEngine):
    """FakeEngine whose requests name a tenant, a tier and a priority; records admission order. Its clock is
    simulated: `now` is the number of steps run (one second each)."""

    def __init__(self, scheduling: str = "fair", weights: tuple[str, ...] = (), catch_up_decodes: str = "auto",
                 lent_seats: int = -1, **kwargs) -> None:
        super().__init__(**kwargs)
        config = self.sched.config
        config.scheduling, config.tenant_weights = scheduling, list(weights)
        config.catch_up_decodes, config.lent_seats = catch_up_decodes, lent_seats
        self.now = 0.0
        self.sched = Scheduler(config, self.bm, 4096, kwargs.get("cost_model"), clock=lambda: self.now)
        self.admitted: list[str] = []
        self.arrived_at: dict[str, int] = {}
        self.admitted_at: dict[str, int] = {}
        self.prompt_tokens: dict[str, int] = {}  # per tenant: the prompt chunks' tokens scheduled

    def add_as(self, rid: str, prompt: list[int], max_tokens: int, tenant: str, tier: str = "default",
               priority: int = 0, root: int = ROOT_HASH, queue_timeout_s: float | None = None) -> SequenceGroup:
        params = SamplingParams(max_tokens=max_tokens, tenant=tenant, service_tier=tier, priority=priority,
                                queue_timeout_s=queue_timeout_s)
        group = SequenceGroup(rid, [Sequence(list(prompt), prefix_root=root)], params, arrival_time=self.now)
        self.sched.add_seq_group(group)
        self.arrived_at[rid] = self.steps
        return group

    def step(self):
        out = super().step()
        assert len({id(item.seq) for item in out.scheduled}) <= self.sched.seat_cap, "more seats than the cap"
        self.now += 1.0
        for item in out.scheduled[: len(out.scheduled) - out.num_decode_tokens]:
            tenant = item.group.sampling_params.tenant
            self.prompt_tokens[tenant] = self.prompt_tokens.get(tenant, 0) + item.num_new_tokens
        for item in out.scheduled:
            rid = item.group.request_id
            if rid not in self.admitted_at:
                self.admitted_at[rid] = self.steps
                self.admitted.append(rid)
        return out

    def counter(self, tenant: str) -> float:
        return self.sched.fair.tenants[tenant].counter

    def assert_tallies(self, requests: dict[str, str]) -> None:
        """Each tenant's tallies are what it was served: its prompt chunks (recomputes too), and the tokens
        its requests (`requests`: request id -> tenant) output."""
        for name, tenant in self.sched.fair.tenants.items():
            outputs = sum(len(self.finished[r][0]) for r, t in requests.items() if t == name)
            assert (tenant.prompt_tokens, tenant.output_tokens) == (self.prompt_tokens.get(name, 0), outputs), name


def _prompt(rid: str, n: int) -> list[int]:
    return [(zlib.crc32(rid.encode()) + i) % 50 for i in range(n)]


# ---- admission order ---------------------------------------------------------------------------------

@pytest.mark.parametrize("scheduling, lent_seats", [("fair", -1), ("fair", 0), ("fcfs", -1)])
def test_chatting_tenant_is_not_queued_behind_a_flood(scheduling, lent_seats):
    """Every seat is the flood's: b0 gets a lent fifth seat at once (no one preempted, and the flood's next
    request waits until the count is back under four), or, lending nothing, the flood's newest request gives
    its seat up; under fcfs b0 waits for the flood."""
    eng = TenantEngine(scheduling, num_blocks=400, max_num_seqs=4, lent_seats=lent_seats)
    for i in range(12):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 8), 20, "flood")
    eng.step()
    eng.add_as("b0", _prompt("b0", 4), 4, "chat")
    eng.step()
    if scheduling == "fair" and lent_seats:
        assert len(eng.sched.running) == 5 and eng.sched.lent == 1
    while eng.sched.has_unfinished_seqs():  # the lent seat is b0's alone: the flood never holds more than four
        eng.step()
        assert sum(g.sampling_params.tenant == "flood" for g in eng.sched.running) <= 4
    waited = eng.admitted_at["b0"] - eng.arrived_at["b0"]
    if scheduling == "fair":
        assert eng.admitted.index("b0") == 4 and waited <= 1
        preempted = 0 if lent_seats else 1
        assert eng.sched.fair.tenants["flood"].preemptions == preempted
        assert eng.sched.fair.tenants["chat"].preemptions == 0
    else:
        assert eng.admitted[-1] == "b0" and waited > 40
    assert all(eng.finished[f"a{i}"] == [reference(_prompt(f"a{i}", 8), 20)] for i in range(12))


@pytest.mark.parametrize("scheduling", ["fair", "fcfs"])
def test_a_chats_prompt_steps_cap_the_floods_prompt_chunks(scheduling):
    """While the least served tenant's prompt runs and in the step after (its first token is read back after
    that one), the other tenants' prompt chunks share `catch_up_chunk_tokens`; then they fill the budget again."""
    eng = TenantEngine(scheduling, num_blocks=400, max_num_seqs=4, max_num_batched_tokens=64)
    cap = eng.sched.catch_up_chunk_tokens
    for i in range(4):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 200), 4, "flood")
    eng.step()
    eng.add_as("b0", _prompt("b0", 12), 4, "chat")
    steps = [eng.step() for _ in range(3)]
    flood = [sum(i.num_new_tokens for i in out.scheduled if i.group.sampling_params.tenant == "flood") for out in steps]
    chat = [sum(i.num_new_tokens for i in out.scheduled if i.group.request_id == "b0") for out in steps]
    if scheduling == "fair":
        assert chat[0] == 12 and flood[:2] == [cap, cap] and flood[2] == 64 - 1
    else:  # the flood's chunks come first: b0 waits for a seat
        assert chat == [0, 0, 0] and flood == [64, 64, 64]
    eng.run()
    assert eng.finished["b0"] == [reference(_prompt("b0", 12), 4)]
    assert all(eng.finished[f"a{i}"] == [reference(_prompt(f"a{i}", 200), 4)] for i in range(4))


def _flood_decodes(out) -> int:
    return sum(1 for i in out.scheduled if i.group.sampling_params.tenant == "flood" and i.num_new_tokens == 1)


@pytest.mark.parametrize(("policy", "want"), [("hold", [0, 0, 12]), ("run", [12, 12, 12]), ("auto", [12, 12, 12])])
def test_an_interactive_tenants_catch_up_steps_hold_the_floods_decodes(policy, want):
    """`catch_up_decodes = "hold"`: the chat's prompt step and the step its first token is read back after run
    none of the flood's decodes; then they all run again. "auto" holds only where a step's sequences cost it
    (the builder says so on the CPU; this scheduler was not told)."""
    eng = TenantEngine(num_blocks=400, max_num_seqs=16, catch_up_decodes=policy)
    for i in range(12):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 8), 40, "flood")
    eng.step()
    eng.step()  # the flood decodes
    eng.add_as("b0", _prompt("b0", 12), 4, "chat")
    assert [_flood_decodes(eng.step()) for _ in range(3)] == want
    eng.run()
    assert eng.finished["b0"] == [reference(_prompt("b0", 12), 4)]
    assert all(eng.finished[f"a{i}"] == [reference(_prompt(f"a{i}", 8), 40)] for i in range(12))


@pytest.mark.parametrize(("queued", "held"), [(1, True), (12, False)])
def test_only_an_interactive_tenants_catch_up_holds_decodes(queued, held):
    """A tenant with no more requests than its equal share of the seats (1 of 8 / 2) is a chat: its catch-up
    holds the others' decodes. One with 12 is a backlog: it catches up whenever one of its many prompts starts,
    so holding then would starve the others (the default model's backlog shares fell to 0.31-0.34)."""
    eng = TenantEngine(catch_up_decodes="hold", num_blocks=800, max_num_seqs=8)
    for i in range(20):  # 8 seated and decoding, 12 waiting: more queued than the newcomer, so it is least served
        eng.add_as(f"b{i}", _prompt(f"b{i}", 8), 40, "busy")
    eng.step()
    eng.step()
    for i in range(queued):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 12), 4, "new")
    out = eng.step()
    assert any(i.group.sampling_params.tenant == "new" for i in out.scheduled), "the newcomer was not seated"
    busy = sum(1 for i in out.scheduled if i.group.sampling_params.tenant == "busy" and i.num_new_tokens == 1)
    assert (busy == 0) == held, busy
    eng.run()
    assert all(eng.finished[f"a{i}"] == [reference(_prompt(f"a{i}", 12), 4)] for i in range(queued))


def test_the_floods_decodes_wait_at_most_catch_up_hold_steps_in_a_row():
    """A chat prompt chunked over many steps catches up in each while its tenant stays the least served (a
    weight of 100 keeps it so), but the flood's decodes wait at most `CATCH_UP_HOLD_STEPS` steps in a row:
    then a step runs them all."""
    eng = TenantEngine(weights=("chat=100",), catch_up_decodes="hold", num_blocks=400, max_num_seqs=16,
                       max_num_batched_tokens=24)
    for i in range(8):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 2), 60, "flood")
    eng.step()
    eng.step()
    eng.add_as("b0", _prompt("b0", 200), 4, "chat")  # 200 tokens in chunks of at most 24
    counts = [_flood_decodes(eng.step()) for _ in range(12)]
    runs, run = [], 0
    for count in counts:
        run = run + 1 if count < 8 else 0
        runs.append(run)
    assert max(runs) == CATCH_UP_HOLD_STEPS and min(counts) == 0, counts
    eng.run()
    assert eng.finished["b0"] == [reference(_prompt("b0", 200), 4)]
    assert all(eng.finished[f"a{i}"] == [reference(_prompt(f"a{i}", 2), 60)] for i in range(8))


def test_a_catch_up_step_admits_no_request_of_another_tenant_without_a_chunk():
    """Once the catch-up cap is spent, the flood's waiting requests stay in the queue: admitted, they would
    compute nothing in the step yet hold their blocks and seats, and no longer be reported as waiting."""
    eng = TenantEngine(num_blocks=400, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(10):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 200), 4, "flood")
    eng.step()
    eng.add_as("b0", _prompt("b0", 12), 4, "chat")
    for _ in range(30):
        waiting = {g.request_id for g in eng.sched.waiting}
        out = eng.step()
        admitted = waiting - {g.request_id for g in eng.sched.waiting}
        assert admitted <= {i.group.request_id for i in out.scheduled if i.num_new_tokens > 0}, admitted
    eng.run()
    assert eng.finished["b0"] == [reference(_prompt("b0", 12), 4)]
    assert all(eng.finished[f"a{i}"] == [reference(_prompt(f"a{i}", 200), 4)] for i in range(10))


def test_a_chats_prompt_is_admitted_before_the_floods_chunks_fill_the_latency_budget():
    """With a latency budget a step that holds a prompt chunk admits nothing more once its predicted time is
    reached: in a catch-up step the least served tenant's prompt is admitted before the others' chunks."""
    eng = TenantEngine(num_blocks=400, max_num_seqs=4, max_step_ms=1.0)  # any chunk fills 1 ms (1 ms a token)
    for i in range(2):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 200), 4, "flood")
    eng.step()
    eng.add_as("b0", _prompt("b0", 12), 4, "chat")
    out = eng.step()
    chunks = [(i.group.request_id, i.num_new_tokens) for i in out.scheduled if i.num_new_tokens > 1]
    assert chunks == [("b0", eng.bs)], chunks  # (one block: the step's first chunk always gets one)
    eng.run()
    assert eng.finished["b0"] == [reference(_prompt("b0", 12), 4)]


def test_a_chats_next_request_gets_a_seat_while_its_first_still_runs():
    """The least served tenant below its equal share of the seats has a request waiting: b0 takes the one seat
    there is to lend (4 // 8, at least 1), and for b1 the flood gives up a seat at once, not when one of its
    requests ends."""
    eng = TenantEngine(num_blocks=400, max_num_seqs=4)
    for i in range(12):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 8), 30, "flood")
    eng.step()
    eng.add_as("b0", _prompt("b0", 4), 12, "chat")
    eng.step()
    eng.add_as("b1", _prompt("b1", 4), 12, "chat")
    eng.step()
    assert eng.admitted_at["b1"] - eng.arrived_at["b1"] <= 1 and "b0" not in eng.finished
    assert eng.sched.fair.tenants["flood"].preemptions == 1 and eng.sched.lent == 1
    eng.run()
    assert all(eng.finished[f"b{i}"] == [reference(_prompt(f"b{i}", 4), 12)] for i in range(2))
    assert all(eng.finished[f"a{i}"] == [reference(_prompt(f"a{i}", 8), 30)] for i in range(12))


def test_one_tenant_schedules_exactly_as_fcfs():
    runs = {}
    for scheduling in ("fair", "fcfs"):
        eng = TenantEngine(scheduling, num_blocks=20, max_num_seqs=6, max_num_batched_tokens=24)
        for i in range(10):
            eng.add_as(f"r{i}", _prompt(f"r{i}", 3 + i), 4 + 2 * i, "solo")
        trace = []
        while eng.sched.has_unfinished_seqs():
            trace.append([(it.group.request_id, it.num_new_tokens) for it in eng.step().scheduled])
        runs[scheduling] = trace, eng.finished
    assert runs["fair"] == runs["fcfs"]


def test_one_tenant_is_charged_every_token_it_is_served():
    eng = TenantEngine(num_blocks=14, max_num_seqs=6, max_num_batched_tokens=24)  # preemptions recompute
    for i in range(10):
        eng.add_as(f"a{i}", _prompt(f"a{i}", 5 + i), 12 + i, "a")
    eng.run()
    assert eng.sched.preemptions_recompute > 0
    eng.assert_tallies({f"a{i}": "a" for i in range(10)})
    tenant = eng.sched.fair.tenants["a"]
    assert tenant.counter == PROMPT_WEIGHT * tenant.prompt_tokens + OUTPUT_WEIGHT * tenant.output_tokens


def test_a_tenant_that_arrives_late_is_lifted_to_the_least_active_counter():
    eng = TenantEngine(num_blocks=400)
    eng.add_as("a0", _prompt("a0", 8), 30, "a")
    eng.add_as("b0", _prompt("b0", 8), 30, "b")
    for _ in range(10):
        eng.step()
    assert eng.counter("a") == eng.counter("b") == PROMPT_WEIGHT * 8 + OUTPUT_WEIGHT * 10
    eng.add_as("c0", _prompt("c0", 8), 4, "c")
    assert eng.counter("c") == eng.counter("a")  # no credit banked for the time it was away


@pytest.mark.parametrize("policy", ["hold", "run"])
@pytest.mark.parametrize(("weights", "share_a", "window"), [((), 0.5, 30), (("a=3",), 0.75, 60)])
def test_backlogged_tenants_get_their_weighted_share_in_every_window(weights, share_a, window, policy):
    """(With `catch_up_decodes = "hold"` too: a backlogged tenant is not interactive, so no decode waits.)"""
    eng = TenantEngine(weights=weights, catch_up_decodes=policy, num_blocks=1200, max_num_seqs=16,
                       max_num_batched_tokens=64)
    for i in range(200):  # both always have work waiting; a's requests are twice as long
        eng.add_as(f"a{i}", _prompt(f"a{i}", 16), 16, "a")
        eng.add_as(f"b{i}", _prompt(f"b{i}", 8), 8, "b")
    served: dict[str, list[float]] = {"a": [], "b": []}
    while len({g.sampling_params.tenant for g in eng.sched.waiting}) == 2:
        out = eng.step()
        tokens = {"a": 0.0, "b": 0.0}
        for item in out.scheduled:
            decode = item.num_new_tokens == 1 and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens
            weight = (0 if decode else PROMPT_WEIGHT * item.num_new_tokens) + OUTPUT_WEIGHT * item.samples
            tokens[item.group.sampling_params.tenant] += weight
        for tenant, history in served.items():
            history.append(tokens[tenant])
    assert len(served["a"]) > 4 * window
    for start in range(window, len(served["a"]) - window, window):
        a, b = (sum(served[t][start:start + window]) for t in ("a", "b"))
        assert a / (a + b) == pytest.approx(share_a, abs=0.05), (start, a, b)


def test_a_request_that_does_not_fit_holds_back_only_its_own_tenant():
    eng = TenantEngine(num_blocks=12, block_size=4)
    eng.add_as("run", _prompt("run", 24), 8, "c")
    eng.step()
    eng.add_as("a-big", _prompt("a-big", 24), 4, "a")  # does not fit beside "run"
    eng.add_as("a-small", _prompt("a-small", 4), 4, "a")  # fits, but waits behind its own tenant's head
    eng.add_as("b-small", _prompt("b-small", 4), 4, "b")  # fits: admitted now, no head-of-line stop
    eng.step()
    assert "b-small" in eng.admitted_at and "a-small" not in eng.admitted_at and "a-big" not in eng.admitted_at
    eng.run()
    assert eng.admitted.index("a-big") < eng.admitted.index("a-small")


def test_a_request_passed_over_too_long_stops_admission_behind_it():
    eng = TenantEngine(num_blocks=12, block_size=4)
    eng.add_as("run", _prompt("run", 24), 8, "c")
    eng.step()
    big = eng.add_as("a-big", _prompt("a-big", 24), 4, "a", priority=-1)  # first in the order, does not fit
    big.arrival_time -= STARVING_S + 1  # it has waited long enough: memory that frees is kept for it
    eng.add_as("b-small", _prompt("b-small", 4), 4, "b")
    eng.step()
    assert "b-small" not in eng.admitted_at
    eng.run()
    assert eng.admitted.index("a-big") < eng.admitted.index("b-small")


# ---- tiers and priorities ----------------------------------------------------------------------------

def test_priority_tier_goes_first_and_flex_only_on_spare_capacity():
    eng = TenantEngine(num_blocks=400, max_num_seqs=2)
    for i in range(4):
        eng.add_as(f"d{i}", _prompt(f"d{i}", 4), 6, "t")
    eng.add_as("f0", _prompt("f0", 4), 6, "t", tier="flex")
    eng.add_as("p0", _prompt("p0", 4), 6, "t", tier="priority")
    eng.add_as("q0", _prompt("q0", 4), 6, "t", priority=-1)  # default tier, vLLM's priority: lower first
    eng.run()
    assert eng.admitted[:3] == ["p0", "q0", "d0"] and eng.admitted[-1] == "f0"


def test_flex_waits_while_a_default_request_does_not_fit():
    eng = TenantEngine(num_blocks=12, block_size=4)
    eng.add_as("big", _prompt("big", 24), 8, "a")  # 6 blocks + growth
    eng.step()
    eng.add_as("d", _prompt("d", 24), 4, "b")  # does not fit beside big
    eng.add_as("f", _prompt("f", 4), 4, "c", tier="flex")  # would fit: spare capacity is not there
    eng.step()
    assert "d" not in eng.admitted_at and "f" not in eng.admitted_at
    eng.run()
    assert eng.admitted == ["big", "d", "f"]


def test_preemption_takes_the_newest_group_of_the_most_served_tenant():
    eng = TenantEngine(num_blocks=14, block_size=4, mode="recompute")
    eng.add_as("b0", _prompt("b0", 4), 30, "b")
    eng.add_as("a0", _prompt("a0", 4), 30, "a")
    eng.add_as("a1", _prompt("a1", 4), 30, "a")
    eng.add_as("b1", _prompt("b1", 4), 30, "b", tier="priority")  # last in, but last to go
    eng.sched.fair.tenants["a"].counter += 100  # a was served more
    while not eng.sched.preemptions_recompute:
        eng.step()
    assert [g.request_id for g in eng.sched.waiting] == ["a1"]
    eng.run()
    assert eng.sched.fair.tenants["a"].preemptions >= 1
    assert all(eng.finished[r] == [reference(_prompt(r, 4), 30)] for r in ("a0", "a1", "b0", "b1"))


# ---- the property: random tenants, weights, tiers and arrivals ---------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_random_tenants_all_finish_correctly_with_bounded_waits(seed):
    rng = random.Random(seed)
    tenants = [f"t{i}" for i in range(rng.randint(2, 5))]
    weights = tuple(f"{t}={rng.choice([0.5, 1, 2, 4])}" for t in tenants)
    mode, swap = rng.choice([("recompute", 0), ("swap", 40), ("auto", 8)])
    eng = TenantEngine(weights=weights, num_blocks=28, watermark=0.05, mode=mode, num_swap_blocks=swap,
                       max_num_seqs=8, max_num_batched_tokens=24,
                       cost_model=CHEAP_SWAP if mode == "auto" else None)
    requests = []
    for i in range(40):
        tenant = rng.choice(tenants)
        requests.append((rng.randrange(3), f"r{i}", _prompt(f"r{i}", rng.randint(1, 20)), rng.randint(1, 20),
                         tenant, rng.choice(["default", "default", "priority", "flex"]), rng.randint(-1, 1)))
    pending = list(requests)
    while pending or eng.sched.has_unfinished_seqs():
        while pending and (pending[0][0] == 0 or not eng.sched.has_unfinished_seqs()):
            _, rid, prompt, max_tokens, tenant, tier, priority = pending.pop(0)
            eng.add_as(rid, prompt, max_tokens, tenant, tier, priority)
        if pending:
            pending[0] = (pending[0][0] - 1, *pending[0][1:])
        eng.step()
        assert eng.steps < 5000, "no progress"
    eng.assert_pool_whole()
    assert not eng.rejected
    for _, rid, prompt, max_tokens, *_ in requests:
        assert eng.finished[rid] == [reference(prompt, max_tokens)]
    # Starvation is bounded: nobody waits longer than the whole workload takes to run one by one.
    bound = sum(len(p) + m for _, _, p, m, *_ in requests)
    assert max(eng.admitted_at[r] - eng.arrived_at[r] for r in eng.admitted_at) < bound
    assert all(t.active == 0 for t in eng.sched.fair.tenants.values())
    eng.assert_tallies({rid: tenant for _, rid, _, _, tenant, *_ in requests})


# ---- starvation: queue deadlines -----------------------------------------------------------------------

def test_a_request_near_its_queue_deadline_goes_ahead_of_a_sustained_priority_load():
    """Priority requests keep both seats busy (two always wait): a default request of their tenant and a flex
    one of another would wait forever. Tiers hold until they have waited half their queue timeout
    (`scheduler.queue_aging`); then they take the next seats that free, oldest first, before their deadline."""
    eng = TenantEngine(num_blocks=400, max_num_seqs=2)
    timeout = 30.0
    late = [eng.add_as("d", _prompt("d", 4), 4, "p", queue_timeout_s=timeout),
            eng.add_as("f", _prompt("f", 4), 4, "q", tier="flex", queue_timeout_s=timeout)]
    n = 0
    while eng.now < 3 * timeout:
        while sum(g.sampling_params.service_tier == "priority" for g in eng.sched.waiting) < 2:
            eng.add_as(f"p{n}", _prompt(f"p{n}", 4), 6, "p", tier="priority", queue_timeout_s=timeout)
            n += 1
        eng.step()
    waited = [g.first_scheduled_time - g.arrival_time for g in late if g.first_scheduled_time is not None]
    assert len(waited) == 2 and all(timeout / 2 <= w < timeout for w in waited), waited
    assert eng.admitted.index("d") < eng.admitted.index("f")
    assert all(eng.finished[r] == [reference(_prompt(r, 4), 4)] for r in ("d", "f"))


def test_each_tenant_s_queue_time_is_the_sum_of_its_requests_waits():
    """The engine view's per-tenant queue time: each request's wait from arrival to its first scheduling,
    summed per tenant, and the admissions counted (a preempted request's re-admission is not a second one)."""
    eng = TenantEngine(num_blocks=400, max_num_seqs=1)
    groups = [eng.add_as(f"r{i}", _prompt(f"r{i}", 4), 3, "a" if i % 2 else "b") for i in range(4)]
    eng.run()
    stats = {row.name: row for row in eng.sched.fair.stats()}
    for tenant in ("a", "b"):
        mine = [g for g in groups if g.sampling_params.tenant == tenant]
        waits = sum(g.first_scheduled_time - g.arrival_time for g in mine)
        assert (stats[tenant].admissions, stats[tenant].queue_seconds) == (len(mine), waits)
    assert sum(row.queue_seconds for row in stats.values()) > 0  # one seat: the later ones waited


@pytest.mark.parametrize("seed", range(8))
def test_no_request_waits_past_its_queue_timeout_below_capacity(seed):
    """Random tenants, weights, tiers, priorities, arrivals and lengths, with a queue timeout of Q steps and
    memory for every seat: every request is first scheduled within Q of its arrival.

    What is assumed (and what the arrivals are shaped to): a request holds a seat for max_tokens <= L = 12
    steps (its prompt in its first step, which samples a token), and the seat-steps of the requests arriving in
    any window of w steps are at most 0.98 * seats * w + B (a leaky bucket: just below capacity on average,
    bursts of B). Waiting work then stays under about B + seats * L seat-steps, so a request that has aged
    (Q/2) waits at most about B / seats + 2L more, behind the older aged ones and the running ones:
    B / seats + 2L = 34 < Q/2 here (seats given up to unserved tenants add recomputed work; the 2% spare
    covers it). Measured: the longest wait is ~53 steps; without aging half the seeds pass Q (up to 135).
    The order below the aged ones stays tier and fair share (the tests above)."""
    rng = random.Random(seed)
    seats, timeout, burst, longest = 6, 100.0, 60.0, 12
    tenants = [f"t{i}" for i in range(rng.randint(2, 5))]
    weights = tuple(f"{t}={rng.choice([0.5, 1, 2, 4])}" for t in tenants)
    eng = TenantEngine(weights=weights, num_blocks=6 * seats * 8, max_num_seqs=seats, max_num_batched_tokens=128)
    level, groups, n = 0.0, [], 0
    while eng.now < 5 * timeout:
        level = max(0.0, level - 0.98 * seats)
        for _ in range(rng.randint(0, 3)):
            max_tokens = rng.randint(1, longest)
            if level + max_tokens > burst:
                break
            level += max_tokens
            tier = rng.choice(["priority", "priority", "priority", "default", "default", "flex"])
            groups.append(eng.add_as(f"r{n}", _prompt(f"r{n}", rng.randint(1, 16)), max_tokens, rng.choice(tenants),
                                     tier, rng.randint(-1, 1), queue_timeout_s=timeout))
            n += 1
        eng.step()
    eng.run()
    waits = {g.request_id: g.first_scheduled_time - g.arrival_time for g in groups}
    assert max(waits.values()) < timeout, max(waits.items(), key=lambda item: item[1])
    assert all(eng.finished[g.request_id] == [reference(g.prompt_token_ids, g.sampling_params.max_tokens)]
               for g in groups)


def test_stats_show_the_most_served_tenants_and_sum_the_rest_as_other():
    eng = TenantEngine(num_blocks=400)
    count = STATS_TENANTS + 6
    for i in range(count):
        eng.add_as(f"r{i}", _prompt(f"r{i}", 4 + i), 1 + i % 5, f"t{i}")
    _check_stats(eng.sched.fair)
    eng.run()
    _check_stats(eng.sched.fair)  # every tenant idle
    eng.add_as("back", _prompt("back", 40), 30, "t0")  # the least served comes back and overtakes the rest
    eng.add_as("new", _prompt("new", 4), 2, "newcomer")
    for _ in range(12):
        eng.step()
        _check_stats(eng.sched.fair)
    eng.run()
    _check_stats(eng.sched.fair)
    assert eng.sched.fair.stats()[0].name == "t0"


def test_a_named_tenants_counts_and_the_others_sum_only_grow(monkeypatch):
    """The server labels tenants by their configured names (`FairShare.named`) and sums the rest as "other":
    a named tenant is always reported one by one (never summed into OTHER when less served than the top 16,
    never forgotten), and forgotten tenants' tallies stay in OTHER, so /metrics' per-label counters only grow."""
    monkeypatch.setattr("streamd.engine.core.fairness.MAX_TENANTS", STATS_TENANTS + 4)  # forget idle ones early
    eng = TenantEngine(num_blocks=400, max_num_seqs=4)
    eng.sched.fair.named = frozenset({"alice", "default"})
    eng.add_as("a0", _prompt("a0", 4), 2, "alice")
    eng.run()
    last: dict[str, tuple[int, int, int]] = {}
    for i in range(2 * STATS_TENANTS + 10):  # more tenants than reported, each served more than alice
        eng.add_as(f"r{i}", _prompt(f"r{i}", 8 + i), 4 + i % 3, f"t{i}")
        for _ in range(3):
            eng.step()
            last = _labels_grow(eng.sched.fair.stats(), last)
    eng.run()
    last = _labels_grow(eng.sched.fair.stats(), last)
    alice = eng.sched.fair.tenants["alice"]
    assert last["alice"] == (alice.prompt_tokens, alice.output_tokens, alice.preemptions)
    assert len(eng.sched.fair.tenants) <= STATS_TENANTS + 4 and eng.sched.fair._forgotten.output_tokens > 0
    assert sum(t[1] for t in last.values()) == sum(len(out[0]) for out in eng.finished.values())


def _labels_grow(rows, last: dict[str, tuple[int, int, int]]) -> dict[str, tuple[int, int, int]]:
    """`rows` summed per label as the server sums them (named tenants by name, the rest "other"); each label's
    tallies are at least those of `last`."""
    labels: dict[str, tuple[int, int, int]] = {}
    for row in rows:
        label = row.name if row.name in ("alice", "default") else "other"
        p, o, n = labels.get(label, (0, 0, 0))
        labels[label] = (p + row.prompt_tokens, o + row.output_tokens, n + row.preemptions)
    for label, before in last.items():
        assert all(a >= b for a, b in zip(labels[label], before)), (label, labels[label], before)
    return labels


def _check_stats(fair) -> None:
    """`fair.stats()`: the STATS_TENANTS - 1 most served tenants as they are, then OTHER summing the rest."""
    rows = fair.stats()
    assert len(rows) == STATS_TENANTS and rows[-1].name == OTHER
    shown, other = rows[:-1], rows[-1]
    for row in shown:
        t = fair.tenants[row.name]
        assert (row.prompt_tokens, row.output_tokens, row.preemptions, row.virtual_tokens) == (
            t.prompt_tokens, t.output_tokens, t.preemptions, t.counter)
    counters = [row.virtual_tokens for row in shown]
    rest = [t for name, t in fair.tenants.items() if name not in {row.name for row in shown}]
    assert counters == sorted(counters, reverse=True) and counters[-1] >= max(t.counter for t in rest)
    assert (other.prompt_tokens, other.output_tokens, other.preemptions, other.virtual_tokens) == (
        sum(t.prompt_tokens for t in rest), sum(t.output_tokens for t in rest), sum(t.preemptions for t in rest),
        max(t.counter for t in rest))


# ---- prefix isolation ---------------------------------------------------------------------------------

def test_a_separate_root_finds_no_other_roots_blocks():
    isolated = prefix_root(None, "b")
    assert isolated not in (ROOT_HASH, prefix_root(None, "a"), prefix_root("s", "b"))
    assert prefix_root(None, None) == ROOT_HASH
    eng = TenantEngine(num_blocks=40, block_size=4)
    prompt = _prompt("shared", 13)
    eng.add_as("a", prompt, 2, "a", root=prefix_root(None, "a"))
    eng.run()
    eng.add_as("b", prompt, 2, "b", root=isolated)
    eng.add_as("a2", prompt, 2, "a", root=prefix_root(None, "a"))
    eng.step()
    cached = {rid: eng.sched._groups[rid].num_cached_tokens for rid in ("b", "a2")}
    assert cached == {"b": 0, "a2": 12}
    eng.run()
    assert eng.finished["b"] == eng.finished["a2"] == [reference(prompt, 2)]


def test_fcfs_config_leaves_counters_out_of_the_order():
    config = SchedulerConfig(scheduling="fcfs")
    assert config.tenant_weight_map() == {}
    eng = TenantEngine("fcfs", num_blocks=400, max_num_seqs=1)
    eng.add_as("a0", _prompt("a0", 4), 2, "a")
    eng.add_as("a1", _prompt("a1", 4), 2, "a")
    eng.add_as("b0", _prompt("b0", 4), 2, "b")
    eng.run()
    assert eng.admitted == ["a0", "a1", "b0"]
