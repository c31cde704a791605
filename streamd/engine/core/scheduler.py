"""Scheduler: iteration-level FCFS scheduling with preemption (paper §4.5). Plain Python, no torch.

It owns the three queues (running, waiting, swapped) and decides, once per step, which sequences run
and how many tokens each; every memory decision goes through the BlockManager. One step, in order:

1. running groups, earliest arrival first: each decoding sequence gets its next slot (copy-on-write
   when its last block is shared). When a group cannot get a block, the latest-arrived running group
   is preempted (all-or-nothing), or the group itself when it is the latest one left.
2. swapped groups come back, earliest first, unless this step preempted (that would thrash).
3. running groups in the middle of a prompt get chunks of the token budget left after the decodes.
   With a latency budget (`scheduler.max_step_ms`) a chunk is also cut to what keeps the step's predicted
   time under it (`StepCost`, fitted to the engine's measured steps: `observe_step`); the first chunk of a
   step gets at least one block, so a prompt always progresses (in a step with nothing else, at least the
   rows from which the model's step costs less per row: `lone_chunk_tokens`).
4. waiting groups are admitted in arrival order (watermark admission, prefix-cache hits), the first
   that does not fit stops admission; nothing is admitted while any group is swapped out or when this
   step preempted. A prompt longer than the remaining budget gets a partial chunk (chunked prefill).
   Admission stops when the step has no token left for another chunk (the token budget, the latency
   budget, a spent catch-up cap): a request admitted without a chunk would hold blocks and a seat idle.
   A group whose prefix continues on disk waits (like one that does not fit) while the disk tier reads it
   ahead, when the step has other work: its reads never stretch a step others run in (`reading_ahead`).
   A group whose prefix continues in the host tier is admitted beside other work with its blocks allocated
   and its host hits copied in ahead, overlapping this step's forward, but computes only from the next step
   (`BlockManager.restoring_ahead`; likewise a group sharing those blocks as prefix hits in this step).

Many tenants, tiers or priorities (`FairShare`, engine/core/fairness.py): each step first orders the queues
by tier, priority, the tenant's fair-share counter and arrival (so "earliest" above reads "most deserving" and
the latest-arrived victim the least deserving); a waiting group that does not fit then holds back only its own
tenant and `flex` requests, not the others, until it has waited `STARVING_S` (then everything after it
waits). A request near its queue deadline (`scheduler.queue_aging` of its queue timeout) goes ahead of every
tier and fair share, oldest first (`_aged_first`), so no load of higher tiers holds it past its deadline.
When every seat is taken and a tenant has nothing running (or holds less than its equal share), its request is
seated beyond `max_num_seqs` (a lent seat, up to `scheduler.lent_seats` more: `_seat_for_unserved`) instead of
preempting another tenant's request, whose whole context would be computed again; the seats are repaid as
requests end. With none left to lend, the most served tenant's cheapest group gives its seat up (recomputed).
When the least served tenant's prompt runs in a step (or its first token is read back after it), the other
tenants' prompt chunks come after its admission and share `scheduler.catch_up_chunk_tokens` in that step
(`_catch_up`), so a chat's first token beside a flood of long prompts waits for steps of a decode step's size;
where a step's sequences cost it (the CPU: `scheduler.catch_up_decodes`) and the tenant caught up is
interactive, the others' decodes wait in those steps too, at most `CATCH_UP_HOLD_STEPS` in a row (a flood's
decodes doubled a chat's two steps on the CPU; benchmarks/NOTES.md, issue 30).
One tenant without tiers keeps the arrival order exactly.

Paused groups (`set_paused`: the server pauses a request whose reader fell behind) are skipped by every
queue; they keep their blocks, and are the first victims when memory runs short: a running group that
needs a block, or a waiting group that cannot be admitted, preempts a paused group before any other. A
paused group swapped out or waiting does not hold back the admission of others.

A group of several sequences (parallel samples, beams) decodes together; a beam group's decodes run all
at once or wait (a beam search step needs every beam's logits), and after a recompute its beams are
prefilled up to their last token, which they then decode together. `replace_beams` applies a beam search
step to the blocks (forks of parents picked several times, dropped beams freed at once).

A prompt's blocks are allocated whole at admission, so chunks never need memory and a running prompt
is only ever stopped by preemption. `max_num_seqs` and the token budget bind only beside other work:
a group that forked past them still comes back alone. Requests come admitted by `Admission` (the engine's
`add_request` checks them against the pool first); a group that outgrew the whole pool since (a recompute
preemption of a long output) is rejected (`SchedulerOutput.rejected`) instead of waiting forever.

The scheduler is the one writer of a sequence's `status` and `num_computed_tokens`: admission, preemption
and resumption here, and after the forward (`update_from_output`, nano-vllm's `postprocess`): each sampled
token appended (or put in its placeholder's place), the token-level stops applied (`StopChecker` says why,
the scheduler finishes the sequence), and the finished sequences freed (`free_finished`). The engine finishes
what only it knows about through the named methods: `stop_choice` (a stop string), `abort_seq_group`,
`finish_group` (a beam search that ended), `fork_samples` (the samples of a completed prompt).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial as partial_call

from streamd.config import SchedulerConfig
from streamd.engine.core.admission import Admission
from streamd.engine.core.block_manager import CopyPairs
from streamd.engine.core.fairness import FLEX, FairShare, aged, starving, tier_of
from streamd.engine.core.hybrid_blocks import BlockSpace
from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput, StepOutcome
from streamd.engine.core.sequence import FINISHED, PLACEHOLDER, Sequence, SequenceGroup, SequenceStatus
from streamd.engine.core.speculation import DEFAULT_ROW_COST, DraftPrice, Speculator
from streamd.engine.core.step_cost import StepCost, StepPeriods, StepShape
from streamd.engine.core.stop_checker import StopChecker
from streamd.engine.outputs import FinishReason, RequestUpdate, SeqUpdate
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import SchedulerStats

_RUNNING = SequenceStatus.RUNNING
_ABORTED = SequenceStatus.FINISHED_ABORTED
TokenFilter = Callable[[Sequence, int], bool]  # False: the sequence's grammar does not allow the token
DEFAULT_SECONDS_PER_TOKEN = 1e-3  # the step cost's prior when no prefill rate was measured
CATCH_UP_HOLD_STEPS = 4  # steps in a row a catch-up may hold other tenants' decodes back (`_holds_decodes`)


@dataclass(slots=True)
class PreemptionCostModel:
    """What `preemption_mode = "auto"` weighs, measured at start-up."""

    bytes_per_block: int
    host_link_bytes_per_s: float
    prefill_tokens_per_s: float

    def swap_cost_s(self, num_blocks: int) -> float:
        """Out now and back in later: the blocks cross the host link twice."""
        return 2 * num_blocks * self.bytes_per_block / self.host_link_bytes_per_s

    def recompute_cost_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        block_manager: BlockSpace,
        max_model_len: int,
        cost_model: PreemptionCostModel | None = None,
        eos_token_ids: Iterable[int] = (),
        speculator: Speculator | None = None,
        clock: Callable[[], float] = time.monotonic,
        named_tenants: Iterable[str] = (),
        lone_chunk_tokens: int = 0,
        sequences_cost: bool = False,
    ) -> None:
        """`named_tenants`: those the stats always report one by one (`FairShare.named`). `lone_chunk_tokens`:
        the least prompt chunk of a step with no other work, whatever the latency budget (the model's rows
        from which a step costs less per row: a low-bit CPU model's dense path, `dense_from_rows`).
        `sequences_cost`: each sequence in a step costs it markedly (the CPU): "auto" catch-ups hold decodes."""
        self.config = scheduler_config
        self.clock = clock  # monotonic seconds, as a group's `arrival_time` (tests simulate time)
        self.speculator = speculator  # draft tokens for decodes (speculative decoding); None: never
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.cost_model = cost_model
        self.preemption_mode = scheduler_config.preemption_mode
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        # Admission keeps running sequences within the token budget too, so every running sequence's
        # decode always fits in one step and no decode is ever starved.
        self.max_num_seqs = min(scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens)
        # beyond max_num_seqs only by a seat lent to an unserved tenant (`_seat_for_unserved`)
        self.seat_cap = min(scheduler_config.seat_cap(), scheduler_config.max_num_batched_tokens)
        self._lent_to: SequenceGroup | None = None  # this step's group seated up to `seat_cap`
        self.lent = 0  # seats lent so far (a count, for stats and tests)
        self.max_step_s = scheduler_config.max_step_ms / 1e3 or None  # None: no latency budget
        self.lone_chunk_tokens = max(block_manager.block_size, lone_chunk_tokens)
        rate = cost_model.prefill_tokens_per_s if cost_model is not None else 0.0
        self.step_cost = StepCost(1 / rate if rate > 0 else DEFAULT_SECONDS_PER_TOKEN)
        self.step_periods = StepPeriods()  # what a drafting step's lost overlap costs (speculation's price)
        self.admission = Admission(max_model_len, block_manager, self.max_num_seqs)
        self.stops = StopChecker(eos_token_ids, max_model_len)
        self.running: list[SequenceGroup] = []  # ordered by arrival
        self.waiting: deque[SequenceGroup] = deque()  # ordered by arrival
        self.swapped: list[SequenceGroup] = []  # ordered by arrival
        self._groups: dict[str, SequenceGroup] = {}
        self._arrival: dict[str, int] = {}  # request_id -> arrival rank (ties in arrival_time broken)
        self._next_rank = 0
        self._lost_tokens: dict[str, int] = {}  # KV tokens a recompute preemption dropped, per request
        self._blocked: tuple[int, int, bool] | None = None  # (head group, free blocks, running?) that failed
        self.paused: set[str] = set()  # request ids not to be scheduled (they keep their blocks)
        self.preemptions_swap = 0
        self.preemptions_recompute = 0
        self.recomputed_tokens = 0
        self._reordered = False  # the queues are in fair order, not arrival order
        weights = scheduler_config.tenant_weight_map()
        self.fair = FairShare(scheduler_config.scheduling == "fair", weights, frozenset(named_tenants))
        self.catch_up_chunk_tokens = scheduler_config.catch_up_chunk_tokens
        policy = scheduler_config.catch_up_decodes
        self.hold_decodes = policy == "hold" or (policy == "auto" and sequences_cost)
        self.queue_aging = scheduler_config.queue_aging
        self._aged = 0  # the waiting groups at the head of the queue that have aged (`_reorder`)
        self._first_token_due: set[str] = set()  # tenants whose prompt ended in the last step (`_catch_up`)
        self._held_steps = 0  # steps in a row whose catch-up held other tenants' decodes back
        self._caught_up: str | None = None  # the tenant the last step caught up (its first token is read back next)

    # ---- requests -------------------------------------------------------------------------------

    def add_seq_group(self, group: SequenceGroup) -> None:
        """Queues a request that `self.admission` admitted (the engine checks every request first)."""
        rid = group.request_id
        if rid in self._groups:
            raise ValueError(f"request {rid!r} is already scheduled")
        seqs = group.unfinished_seqs()
        if not seqs or any(s.num_tokens == 0 for s in seqs):
            raise ValueError(f"request {rid!r} has no prompt tokens to run")
        for seq in seqs:
            seq.status = SequenceStatus.WAITING
        self._groups[rid] = group
        self._arrival[rid] = self._next_rank
        self._next_rank += 1
        self.fair.arrive(group)
        self.waiting.append(group)

    def abort_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Removes the request from every queue and frees its blocks now."""
        group = self.remove_seq_group(request_id)
        if group is not None:
            self.finish_group(group, _ABORTED)
        return group

    def remove_seq_group(self, request_id: str) -> SequenceGroup | None:
        """Removes the request from whichever queue holds it and frees its blocks, leaving its statuses
        alone (a request that finished while preempted)."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        rank = self._rank(group)
        for ordered in (self.running, self.swapped):  # both kept in arrival order: find by bisection
            i = bisect.bisect_left(ordered, rank, key=self._rank)
            if i < len(ordered) and ordered[i] is group:
                del ordered[i]
                break
        else:  # in waiting, or the fair share reordered the queues (not by arrival)
            for queue in (self.running, self.swapped, self.waiting):
                if group in queue:
                    queue.remove(group)
                    break
        for seq in group.seqs:
            self.block_manager.free(seq)
        self._forget(group)
        return group

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stops (or restarts) scheduling a request; unknown ids (already finished) are ignored."""
        if paused and request_id in self._groups:
            self.paused.add(request_id)
        else:
            self.paused.discard(request_id)
        self._blocked = None

    def has_runnable(self) -> bool:
        """Whether some queued group is not paused (a step could make progress)."""
        return len(self.running) + len(self.waiting) + len(self.swapped) > len(self.paused)

    def fork_seq(self, group: SequenceGroup, parent: Sequence, child: Sequence | None = None) -> Sequence:
        """A new sequence of `group` (or `child`, made beforehand) sharing `parent`'s blocks (parallel
        sampling). Its sample index is its place in the group: its own seeded random stream."""
        child = parent.fork(child)
        child.status, child.num_computed_tokens = parent.status, parent.num_computed_tokens
        child.sample_index = len(group.seqs)
        self.block_manager.fork(parent, child)
        group.seqs.append(child)
        return child

    def replace_beams(self, group: SequenceGroup, parents: list[Sequence]) -> list[Sequence]:
        """A beam search step: the group's next beams, one per entry of `parents` (each next beam's
        parent, best first). A parent's first child continues the parent itself, further children are
        forks sharing its blocks; a beam no child continues is freed at once. Returns the next beams in
        the order of `parents` (the caller appends their tokens)."""
        chosen = {id(parent) for parent in parents}
        for beam in group.seqs:
            if id(beam) not in chosen:
                beam.status = _ABORTED
                self.block_manager.free(beam)
        group.seqs = [beam for beam in group.seqs if id(beam) in chosen]
        continued: set[int] = set()
        beams = []
        for parent in parents:
            if id(parent) in continued:
                beams.append(self.fork_seq(group, parent))
            else:
                continued.add(id(parent))
                beams.append(parent)
        group.seqs = beams
        return beams

    # ---- the step -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This iteration's plan (see the module docstring for the order)."""
        out = SchedulerOutput()
        seat_free = False
        self._lent_to = None
        if self.fair.reorders:
            seat_free = self._seats_taken() < self.max_num_seqs
            self._reorder(seat_free)
            seat_free = seat_free or self._seat_for_unserved(out)
        elif self._reordered:
            self._restore_arrival_order()
        decodes: list[ScheduledSeq] = []
        partial: list[ScheduledSeq] = []  # prompt chunks, sized once the decodes have their tokens
        # A catch-up that may hold decodes is decided before they are scheduled (scanning the running groups
        # for the tenant's prompt); one that only caps prompt chunks after, from the chunks found (no scan).
        catch_up = self._catch_up(seat_free, None) if self.fair.reorders and self.hold_decodes else None
        num_seqs, preempted = self._schedule_running(out, decodes, partial, catch_up)
        budget = self.max_num_batched_tokens - len(decodes)
        if not preempted:
            num_seqs, budget = self._schedule_swapped(out, decodes, partial, num_seqs, budget)
        prefills: list[ScheduledSeq] = []
        num_drafts = self._add_drafts(out, decodes, budget)
        budget -= num_drafts
        shape = out.shape
        shape.tokens = len(decodes) + num_drafts
        if self.fair.reorders and not self.hold_decodes:
            catch_up = self._catch_up(seat_free, partial)
        later = []  # with a catch-up: the other tenants' running prompts, chunked after the admission
        if catch_up is not None:
            later = [item for item in partial if item.group.sampling_params.tenant != catch_up.tenant]
            partial = [item for item in partial if item.group.sampling_params.tenant == catch_up.tenant]
        budget = self._schedule_chunks(shape, partial, prefills, budget, catch_up)
        if not preempted and not self._holds_back_admission():
            budget = self._schedule_waiting(out, prefills, num_seqs, budget, catch_up)
            self.block_manager.end_step()
        self._schedule_chunks(shape, later, prefills, budget, catch_up)
        out.num_prefill_tokens = sum(item.num_new_tokens for item in prefills)
        out.num_decode_tokens = len(decodes)
        out.num_draft_tokens = num_drafts
        self.fair.charge(prefills, decodes)
        self._first_token_due = _first_tokens(prefills) if self.fair.reorders else set()
        self._held_steps = self._held_steps + 1 if catch_up is not None and catch_up.held else 0
        self._caught_up = catch_up.tenant if catch_up is not None else None
        prefills.extend(decodes)
        out.scheduled = prefills
        out.tier_orders = self.block_manager.take_tier_orders()
        return out

    def _schedule_chunks(
        self,
        shape: StepShape,
        partial: list[ScheduledSeq],
        prefills: list[ScheduledSeq],
        budget: int,
        catch_up: _CatchUp | None,
    ) -> int:
        """The running prompts' next chunks (into `prefills`) within `budget` and the catch-up's cap; returns
        the budget left."""
        for item in partial:
            item.num_new_tokens = self._chunk(
                shape, item.seq, _allowed(catch_up, item.group, item.num_new_tokens), budget
            )
            if item.num_new_tokens <= 0:
                if catch_up is None:  # the budget ran out: the rest get nothing either
                    break
                continue
            budget -= item.num_new_tokens
            prefills.append(item)
        return budget

    def _seats_taken(self) -> int:
        """The running sequences with a token to compute this step. A sequence that its last token ended is
        still in `running` until that token is read back, a step later (the overlapped loop), but its seat
        is already free: counting it would hold the waiting queue in arrival order at saturation."""
        return sum(_has_work(seq) for group in self.running for seq in group.seqs)

    def _reorder(self, seat_free: bool) -> None:
        """Tiers, priorities and fair shares order the queues (`FairShare.key`): running and swapped most
        deserving first (victims come off the end), waiting as `FairShare.waiting_order` says when a seat
        is free (else none can be admitted)."""
        fair, rank = self.fair, self._arrival
        self._reordered = True
        self.running.sort(key=lambda g: fair.key(g, rank[g.request_id]))
        self.swapped.sort(key=lambda g: fair.key(g, rank[g.request_id]))
        self._aged = 0
        if len(self.waiting) > 1 and seat_free:
            order = self._aged_first(fair.waiting_order(sorted(self.waiting, key=self._rank), rank))
            self.waiting.clear()
            self.waiting.extend(order)

    def _aged_first(self, order: list[SequenceGroup]) -> list[SequenceGroup]:
        """`order` with the groups that have `aged` (near their queue deadline) moved ahead, oldest first."""
        now, aging = self.clock(), self.queue_aging
        old = [group for group in order if aged(group, now, aging)]
        if not old:
            return order
        self._aged = len(old)
        old.sort(key=self._rank)
        return [*old, *(group for group in order if not aged(group, now, aging))]

    def _seat_for_unserved(self, out: SchedulerOutput) -> bool:
        """Every seat (`max_num_seqs`) is taken and an active tenant has nothing running, or the least served
        one holds fewer than its equal share of the seats (a chat's next request behind a flood): that tenant's
        first waiting request goes to the front of the queue and is seated beyond `max_num_seqs` (a lent seat,
        up to `seat_cap`; nobody else is admitted until the count is back under `max_num_seqs`), or, with no
        seat left to lend, the group of the tenant running the most groups with the fewest computed tokens (the
        cheapest to recompute; of those the least deserving) gives up its seat (recomputed). Returns whether
        it made a seat."""
        running = self.running
        if self.swapped:
            return False
        seats = Counter(g.sampling_params.tenant for g in running)
        unserved = self.fair.unserved(seats)
        least = self.fair.least_served()
        if least is not None and self.fair.queued_beyond(least, seats[least], self.max_num_seqs):
            unserved.add(least)
        if not unserved or seats.most_common(1)[0][1] < 2:
            return False
        candidate = next((g for g in self.waiting if _may_take_seat(g, unserved, self.paused)), None)
        if candidate is None:
            return False
        if self._seats_taken() + len(candidate.seqs) <= self.seat_cap:
            self.lent += 1
        else:
            richest = seats.most_common(1)[0][0]
            mine = [i for i, g in enumerate(running) if g.sampling_params.tenant == richest]
            victim = min(mine, key=lambda i: (_computed_tokens(running[i]), -i))  # the cheapest to recompute
            self._preempt(running.pop(victim), out, recompute=True)
        self._lent_to = candidate
        self.waiting.remove(candidate)
        self.waiting.appendleft(candidate)
        return True

    def _catch_up(self, seat_free: bool, partial: list[ScheduledSeq] | None) -> _CatchUp | None:
        """The step's cap on the other tenants' prompt chunks and decodes when the least served tenant's prompt
        runs in it (a chunk of it, or, with a seat free, its first waiting request seated first) or its first
        token, sampled in the last step, is read back after it (outputs trail the device by a step; then the
        tenant the last step caught up, whom its prompt's charge may have made no longer the least served):
        that tenant's first token then waits for steps near its own work's duration, not for ones full of
        the others' prompts and decodes. `partial`: the step's running prompt chunks, once known (None: the
        running groups are scanned)."""
        least = self.fair.least_served()
        if least is None:
            return None
        tenant = self._caught_up if self._caught_up in self._first_token_due else least  # (charged, no longer least)
        due = tenant in self._first_token_due or self._prompt_running(tenant, partial)
        if not due and seat_free:
            due = self._seat_first(tenant)
        if not due:
            return None
        spared = self._first_token_due | {tenant}  # whose decodes run (a first token read back is one to protect too)
        return _CatchUp(tenant, self.catch_up_chunk_tokens, self._holds_decodes(tenant), frozenset(spared))

    def _prompt_running(self, tenant: str, partial: list[ScheduledSeq] | None) -> bool:
        """Whether a running (not paused) group of `tenant` has prompt tokens left to compute (one of the
        step's chunks `partial`, when they are known)."""
        if partial is not None:
            return any(item.group.sampling_params.tenant == tenant for item in partial)
        paused = self.paused
        mine = (g for g in self.running if g.sampling_params.tenant == tenant and g.request_id not in paused)
        return any(any(map(_prompt_left, group.seqs)) for group in mine)

    def _holds_decodes(self, tenant: str) -> bool:
        """Whether a catch-up step for `tenant` holds the other tenants' decodes back: where they cost (the CPU,
        `scheduler.catch_up_decodes`), for an interactive tenant (`FairShare.interactive`: a backlogged one
        catches up all the time, and holding would starve the others), at most `CATCH_UP_HOLD_STEPS` in a row."""
        if not self.hold_decodes or self._held_steps >= CATCH_UP_HOLD_STEPS:
            return False
        return self.fair.interactive(tenant, self.max_num_seqs)

    def _seat_first(self, tenant: str) -> bool:
        """Moves `tenant`'s first waiting request to the head of the queue, past those of the head's tier and
        priority only (it has the least counter: it passes only ties, e.g. a tenant just lifted to another's
        counter); returns whether it is there. Never past a group that has aged. O(the head's tier and priority
        class)."""
        waiting = self.waiting
        head = _order_class(waiting[0]) if waiting else None
        if self._aged:
            return _may_take_seat(waiting[0], {tenant}, self.paused)
        for k, group in enumerate(waiting):
            if _order_class(group) != head:
                return False
            if _may_take_seat(group, {tenant}, self.paused):
                del waiting[k]
                waiting.appendleft(group)
                return True
        return False

    def _restore_arrival_order(self) -> None:
        """Back to arrival order once nothing reorders (one tenant left, no tiers): the queues' invariant."""
        self._reordered = False
        self.running.sort(key=self._rank)
        self.swapped.sort(key=self._rank)
        order = sorted(self.waiting, key=self._rank)
        self.waiting.clear()
        self.waiting.extend(order)

    def may_speculate(self) -> bool:
        """Whether the next step may draft (then the engine takes the previous step's tokens first: drafts
        continue them, so the step is not overlapped): few enough running sequences, one of which may draft at the
        step's price (wants to, is not pausing after failed drafts, and some draft length pays beside the others).
        O(1) past `disable_by_batch_size` groups."""
        spec, running = self.speculator, self.running
        if spec is None or not spec.step_allowed(len(running)):  # (more groups: more sequences too)
            return False
        live = [(seq, group) for group in running for seq in group.seqs if seq.status is _RUNNING]
        if not spec.step_allowed(len(live)):
            return False
        decoding = [(seq, group) for seq, group in live if seq.prompt_computed]
        if not any(spec.wants(group) for _, group in decoding):
            return False
        # priced as `_add_drafts` will (its decodes: the sequences past their prompts) so the two agree
        price, others = self._draft_price(len(decoding)), len(decoding) - 1
        return any(spec.may_draft(seq, group, price, others) for seq, group in decoding)

    def _add_drafts(self, out: SchedulerOutput, decodes: list[ScheduledSeq], budget: int) -> int:
        """Draft tokens for the step's decodes (speculative decoding), within the token `budget` and the free
        blocks above the watermark (a draft never preempts); returns how many."""
        spec, bm = self.speculator, self.block_manager
        if spec is None or not spec.step_allowed(len(decodes)):
            return 0
        if not any(spec.wants(item.group) for item in decodes):  # (then no fit for a row's price: most steps)
            return 0
        price = self._draft_price(len(decodes))
        total, others = 0, len(decodes) - 1
        for item in decodes:
            draft = spec.propose(item.seq, item.group, budget - total, price, others) if budget > total else None
            if draft is None:
                continue
            slots = 1 + len(draft.token_ids)
            if not bm.can_append(item.seq, slots):
                continue
            out.blocks_to_copy.extend(bm.append_slots(item.seq, slots))
            item.draft = draft
            total += len(draft.token_ids)
        return total

    def _chunk(self, shape: StepShape, seq: Sequence, wanted: int, budget: int) -> int:
        """The tokens of `seq`'s next prompt chunk: what it wants within the token `budget` and, with a
        latency budget, what keeps the step's predicted time under it (at least one block when the step
        has no chunk yet); counted into `shape`."""
        tokens = min(wanted, budget)
        context = seq.num_computed_tokens
        if self.max_step_s is not None and tokens > 0:
            fits = self.step_cost.max_chunk(shape, context, self.max_step_s)
            tokens = min(tokens, fits if shape.pairs else max(fits, self._least_chunk(shape)))
        if tokens > 0:
            shape.add_chunk(tokens, context)
        return tokens

    def _least_chunk(self, shape: StepShape) -> int:
        """A step's first chunk: one block beside decodes (their inter-token latency is what the budget keeps),
        `lone_chunk_tokens` when nothing else runs (a waiting request's admission is all it delays)."""
        return self.lone_chunk_tokens if shape.tokens == 0 else self.block_manager.block_size

    def _step_full(self, shape: StepShape) -> bool:
        """Whether the step already holds a prompt chunk and not one more prompt token fits the latency budget.
        Admission stops there: a request admitted with no chunk would hold its blocks and a seat while it
        computes nothing, and leave the queue, where its place is reported."""
        if self.max_step_s is None or not shape.pairs:
            return False
        return self.step_cost.max_chunk(shape, 0, self.max_step_s) <= 0

    def _draft_price(self, num_decodes: int) -> DraftPrice:
        return DraftPrice(self._row_cost(num_decodes), self.step_periods.serial_overhead())

    def _row_cost(self, num_decodes: int) -> float:
        row_cost = self.step_cost.row_cost(num_decodes)
        return DEFAULT_ROW_COST if row_cost is None else row_cost  # (no step without a chunk measured yet)

    def observe_period(self, out: SchedulerOutput, seconds: float, overlapped: bool, waited: SchedulerOutput) -> None:
        """The engine measured the wall seconds from the start of the step `out` planned to the next one's, whether
        its host work overlapped the device's, and the step whose device time a serial step waited for first
        (`waited`, the one before). Decode steps few enough to draft beside (`disable_by_batch_size`) teach
        `step_periods` (with a speculator); a serial period's draft rows are `waited`'s."""
        spec = self.speculator
        if spec is None or out.shape.pairs or waited.shape.pairs or not spec.step_allowed(out.num_decode_tokens):
            return
        drafts = waited.num_draft_tokens  # (the fit is asked only then: tens of microseconds, a step can be ~1 ms)
        rows = drafts * self._row_cost(waited.num_decode_tokens) if drafts and not overlapped else 0.0
        self.step_periods.observe(seconds, overlapped, rows)

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """The engine measured the step `out` planned: the step cost learns from it (only with a latency
        budget or a speculator: without them nothing reads the fit)."""
        if self.max_step_s is not None or self.speculator is not None:
            self.step_cost.observe(out.shape, seconds)

    def _schedule_running(
        self,
        out: SchedulerOutput,
        decodes: list[ScheduledSeq],
        partial: list[ScheduledSeq],
        catch_up: _CatchUp | None,
    ) -> tuple[int, bool]:
        bm, running, paused = self.block_manager, self.running, self.paused
        budget = self.max_num_batched_tokens
        num_seqs, preempted, i = 0, False, 0
        while i < len(running):  # victims are popped off the end (or are paused groups)
            group = running[i]
            if paused and group.request_id in paused:
                i += 1
                continue
            if len(group.seqs) > 1:
                count, group_preempted, i = self._schedule_group(group, i, out, decodes, partial, budget, catch_up)
                preempted |= group_preempted
                if count >= 0:
                    num_seqs += count
                    budget = self.max_num_batched_tokens - len(decodes)
                    i += 1
                continue
            seq = group.seqs[0]  # the common case, kept lean: this loop runs every step
            left = len(seq.token_ids) - seq.num_computed_tokens
            if seq.status is not _RUNNING or left < 1:
                i += 1
                continue
            num_seqs += 1
            if left > 1:
                copies = bm.try_cover_prompt(seq)  # (the hybrid layout's window blocks for the chunk)
                if copies is None:
                    preempted = True
                    copies, i = self._make_room(i, out, partial_call(bm.try_cover_prompt, seq))
                    if copies is None:  # it was preempted itself
                        num_seqs -= 1
                        continue
                if copies:
                    out.blocks_to_copy.extend(copies)
                partial.append(ScheduledSeq(seq, group, left))
            elif catch_up is not None and catch_up.holds(group, 1):  # (inline: this runs per decode, every step)
                pass  # another tenant's decode waits while the least served tenant catches up
            elif budget:  # budget only runs out when forks outgrew it
                copies = bm.try_append_slots(seq)
                if copies is None:
                    preempted = True
                    copies, i = self._make_room(i, out, partial_call(bm.try_append_slots, seq))
                    if copies is None:  # it was preempted itself
                        num_seqs -= 1
                        continue
                if copies:
                    out.blocks_to_copy.extend(copies)
                decodes.append(ScheduledSeq(seq, group, 1))
                budget -= 1
            i += 1
        return num_seqs, preempted

    def _make_room(
        self, i: int, out: SchedulerOutput, attempt: Callable[[], CopyPairs | None]
    ) -> tuple[CopyPairs | None, int]:
        """Preempts the latest-arrived groups other than running[i] until `attempt` (a slot append of
        running[i]'s) succeeds; returns its copies and i now. When running[i] is the latest-arrived group left,
        it is preempted itself and the copies are None."""
        running = self.running
        while True:
            victim = self._victim(i)
            if victim is None:  # the latest-arrived group left is this one
                self._preempt(running.pop(i), out)
                return None, i
            self._preempt(running.pop(victim), out)
            i -= victim < i
            copies = attempt()
            if copies is not None:
                return copies, i

    def _schedule_group(
        self,
        group: SequenceGroup,
        i: int,
        out: SchedulerOutput,
        decodes: list[ScheduledSeq],
        partial: list[ScheduledSeq],
        budget: int,
        catch_up: _CatchUp | None,
    ) -> tuple[int, bool, int]:
        """A group of several sequences at running[i], all or nothing. Returns (its live sequences, or
        -1 when it preempted itself; whether anything was preempted; its index now)."""
        bm, running = self.block_manager, self.running
        writers, prompts = _running_parts(group)
        if not _decode_now(group, writers, prompts, budget) or (
            writers and catch_up is not None and catch_up.holds(group, len(writers))
        ):
            writers = []
        preempted = False
        while not (bm.can_append_all(writers) and bm.can_cover_prompts([item.seq for item in prompts])):
            preempted = True
            victim = self._victim(i)
            if victim is None:
                self._preempt(running.pop(i), out)
                return -1, True, i
            self._preempt(running.pop(victim), out)
            i -= victim < i
        self._append_decodes(group, writers, out, decodes, budget)
        out.blocks_to_copy.extend(bm.cover_prompts([item.seq for item in prompts]))
        partial.extend(prompts)
        return len(writers) + len(prompts), preempted, i

    def _append_decodes(
        self,
        group: SequenceGroup,
        writers: list[Sequence],
        out: SchedulerOutput,
        decodes: list[ScheduledSeq],
        budget: int,
    ) -> None:
        """Each writer's next slot (its blocks checked beforehand); fewer only when forks outgrew the
        budget, the rest wait."""
        bm = self.block_manager
        for seq in writers[:budget]:
            out.blocks_to_copy.extend(bm.append_slots(seq))
            decodes.append(ScheduledSeq(seq, group, 1))

    def _schedule_swapped(
        self, out: SchedulerOutput, decodes: list[ScheduledSeq], partial: list[ScheduledSeq], num_seqs: int, budget: int
    ) -> tuple[int, int]:
        bm, k = self.block_manager, 0
        while k < len(self.swapped):
            group = self.swapped[k]
            if group.request_id in self.paused:
                k += 1
                continue
            seqs = group.seqs_with_status(SequenceStatus.SWAPPED)
            # Limits bind only beside others: a group that outgrew them alone (forks) still runs.
            if num_seqs and (num_seqs + len(seqs) > self.max_num_seqs or len(seqs) > budget):
                break
            needed = bm.blocks_to_swap_in(seqs)
            if needed > bm.num_blocks:
                self._reject(self.swapped.pop(k), out, needed)
                continue
            # The watermark must not keep the pool idle: with nothing running, anything that fits goes.
            if not bm.can_swap_in(seqs, None if self.running else 0):
                break
            out.blocks_to_swap_in.extend(bm.swap_in(seqs))
            self.swapped.pop(k)
            for seq in seqs:
                seq.status = _RUNNING
            writers, prompts = _running_parts(group)  # prompts: swapped in the middle of their prompt
            out.blocks_to_copy.extend(bm.cover_prompts([item.seq for item in prompts]))
            partial.extend(prompts)
            if _decode_now(group, writers, prompts, budget):
                before = len(decodes)
                self._append_decodes(group, writers, out, decodes, budget)
                budget -= len(decodes) - before
            num_seqs += len(seqs)
            bisect.insort(self.running, group, key=self._rank)
        return num_seqs, budget

    def _schedule_waiting(
        self, out: SchedulerOutput, prefills: list[ScheduledSeq], num_seqs: int, budget: int, catch_up: _CatchUp | None
    ) -> int:
        """Admits waiting groups in queue order (the module docstring's step 4); returns the budget left."""
        bm, waiting, k = self.block_manager, self.waiting, 0
        skip = _Skipped() if self.fair.reorders else None  # else the first that does not fit stops admission
        while k < len(waiting) and budget > 0 and not self._step_full(out.shape):
            group = waiting[k]
            if (self.paused and group.request_id in self.paused) or (skip is not None and skip.holds(group)):
                k += 1
                continue
            if skip is not None and catch_up is not None and catch_up.spent_for(group):
                skip.add(group)  # admitted now it would take no chunk (`_step_full` says why it must not)
                if skip.holds_all(waiting):
                    break
                k += 1
                continue
            seqs = group.seqs_with_status(SequenceStatus.WAITING)
            if num_seqs and num_seqs + len(seqs) > (self.seat_cap if group is self._lent_to else self.max_num_seqs):
                break
            needed = sum(bm.blocks_needed(s.num_tokens) for s in seqs)
            if needed > bm.num_blocks:  # grew past the pool before a recompute preemption
                self._reject(waiting[k], out, needed)
                del waiting[k]
                continue
            # Re-checking a blocked head costs a prefix lookup; skip it until the free count changes (new
            # prefix-cache entries alone do not re-trigger it: they only delay admission by some steps).
            blocked = (id(group), bm.free_state(), bool(self.running))
            reserve = (bm.watermark_blocks if self.running else 0) + self._growth_blocks(group, needed)
            reuse = group.sampling_params.prompt_logprobs is None  # prompt logprobs: every position computed
            if blocked == self._blocked or not bm.can_allocate(seqs, reserve, reuse):
                if self._preempt_paused(out):  # memory held by a stalled reader goes first
                    continue
                self._blocked = blocked
                if skip is None or starving(group, self.clock(), self.queue_aging) or _held_back(skip, group, waiting):
                    break
                k += 1
                continue
            if reuse and out.shape.tokens and bm.reading_ahead(seqs):  # its prefix is read from disk a step ahead
                if skip is None or _held_back(skip, group, waiting):
                    break
                k += 1
                continue
            del waiting[k]
            cached = 0
            for seq in seqs:
                seq.num_computed_tokens = hits = bm.allocate(seq, reuse, ahead=bool(out.shape.tokens))
                cached += hits
                seq.status = _RUNNING
                if bm.restoring_ahead(seq):  # its blocks arrive during this step's forward: it computes next step
                    continue
                wanted = group.prefill_end(seq) - seq.num_computed_tokens
                chunk = self._chunk(out.shape, seq, _allowed(catch_up, group, wanted), budget)
                if chunk > 0:  # otherwise it continues as a running prompt next step
                    prefills.append(ScheduledSeq(seq, group, chunk))
                    budget -= chunk
                    bm.publish_in_step(seq, seq.num_computed_tokens + chunk)
            lost = self._lost_tokens.pop(group.request_id, None)
            if lost is None:  # its first admission (a recompute preemption leaves its lost tokens)
                group.num_cached_tokens = cached
                group.first_scheduled_time = self.clock()
                self.fair.admitted(group, group.first_scheduled_time - group.arrival_time)
            else:
                self.recomputed_tokens += max(0, lost - cached)
            num_seqs += len(seqs)
            bisect.insort(self.running, group, key=self._rank)
        return budget

    def _growth_blocks(self, group: SequenceGroup, needed: int) -> int:
        """Blocks a group of several sequences keeps free at admission beyond the `needed` ones it
        allocates now, so that its worst case fits."""
        worst = self.admission.worst_case_blocks(len(group.prompt_token_ids), group.sampling_params)
        return max(0, worst - needed)

    # ---- preemption -----------------------------------------------------------------------------

    def _victim(self, i: int) -> int | None:
        """Which running group to preempt so that running[i] can go on: the latest-arrived paused group,
        else the latest-arrived group; None when that is running[i] itself."""
        running = self.running
        if self.paused:
            for j in range(len(running) - 1, -1, -1):
                if j != i and running[j].request_id in self.paused:
                    return j
        return None if len(running) == i + 1 else len(running) - 1

    def _preempt_paused(self, out: SchedulerOutput) -> bool:
        """Preempts the latest-arrived running paused group, if any (to admit a waiting one)."""
        victim = self._victim(-1) if self.paused else None
        if victim is None or self.running[victim].request_id not in self.paused:
            return False
        self._preempt(self.running.pop(victim), out)
        return True

    def _holds_back_admission(self) -> bool:
        """Swapped groups come back before anything new is admitted; paused ones do not hold it back."""
        if not self.swapped or not self.paused:
            return bool(self.swapped)
        return len(self.swapped) > sum(1 for g in self.swapped if g.request_id in self.paused)

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput, recompute: bool = False) -> None:
        bm = self.block_manager
        seqs = [s for s in group.seqs if s.status < FINISHED]
        self.fair.preempted(group)
        if self.speculator is not None:
            self.speculator.preempted(group)  # (a draft model's cache of it goes with its KV)
        if not recompute and self._use_swap(seqs):
            out.blocks_to_swap_out.extend(bm.swap_out(seqs))
            for seq in seqs:
                seq.status = SequenceStatus.SWAPPED
            bisect.insort(self.swapped, group, key=self._rank)
            self.preemptions_swap += 1
            return
        lost = 0
        for seq in seqs:
            lost += seq.num_computed_tokens
            bm.free(seq)
            seq.num_computed_tokens = 0  # prompt + generated tokens are prefilled again
            seq.status = SequenceStatus.WAITING
        self._lost_tokens[group.request_id] = lost
        self._requeue_front(group)
        self.preemptions_recompute += 1

    def _use_swap(self, seqs: list[Sequence]) -> bool:
        bm = self.block_manager
        if self.preemption_mode == "recompute" or not bm.num_swap_blocks or not bm.can_swap_out(seqs):
            return False  # recompute is also the fallback when the host pool is full
        if self.preemption_mode == "swap":
            return True
        if self.cost_model is None:
            return False
        tokens = sum(s.num_computed_tokens for s in seqs)
        return self.cost_model.swap_cost_s(bm.unique_blocks(seqs)) < self.cost_model.recompute_cost_s(tokens)

    def _requeue_front(self, group: SequenceGroup) -> None:
        """Back into waiting by arrival; preempted groups arrived before any never-admitted one, so
        this is at or near the front."""
        rank, i = self._rank(group), 0
        for other in self.waiting:
            if self._rank(other) > rank:
                break
            i += 1
        self.waiting.insert(i, group)

    def _reject(self, group: SequenceGroup, out: SchedulerOutput, needed: int) -> None:
        """A group that outgrew the whole pool: it can never run again. The engine reports it."""
        for seq in group.seqs:
            self.block_manager.free(seq)
        self.finish_group(group, _ABORTED)
        bm = self.block_manager
        out.rejected.append(
            (
                group,
                f"request {group.request_id!r} needs {needed} KV cache blocks but the KV "
                f"cache has only {bm.num_blocks} blocks of {bm.block_size} tokens",
            )
        )
        self._forget(group)

    # ---- after the forward ----------------------------------------------------------------------

    def on_step_done(self, out: SchedulerOutput) -> None:
        """The forward wrote the KV of every scheduled token: advance and publish full blocks."""
        bm = self.block_manager
        caching, bs = bm.follows_progress, bm.block_size
        for item in out.scheduled:
            seq = item.seq
            if seq.status is not _RUNNING:  # aborted while the step ran
                continue
            before = seq.num_computed_tokens
            seq.num_computed_tokens = after = before + item.num_new_tokens
            if caching and after // bs != before // bs:
                bm.mark_computed(seq)

    def update_from_output(
        self,
        sampling: list[ScheduledSeq],
        token_ids: list[int],
        logprobs: list[dict[int, float]] | None,
        accept: TokenFilter | None = None,
    ) -> StepOutcome:
        """A step's sampled tokens (row i: `sampling[i]`): each unfinished sequence gets its token (in its
        placeholder's place when one stands for it), the grammar `accept`s it (a refusal is a dead end) and
        the token-level stops apply. Returns each request's news and the groups in which a sequence ended
        (for `free_finished`, once the caller has added its own)."""
        check, kept = self.stops.check, 0
        updates: dict[str, RequestUpdate] = {}
        ended: list[SequenceGroup] = []
        for i, item in enumerate(sampling):
            seq = item.seq
            if seq.status >= FINISHED:  # aborted, or stopped a step earlier: this token is void
                continue
            token, group = token_ids[i], item.group
            seq.receive_token(token)
            update = updates.get(group.request_id)
            if update is None:
                update = updates[group.request_id] = RequestUpdate(
                    group.request_id, [], group.num_cached_tokens, group.first_scheduled_time
                )
            if accept is not None and not accept(seq, token):
                update.seqs.append(self._dead_end(seq, update))
                ended.append(group)
                continue
            kept += 1
            params = group.sampling_params
            reason, stop_token_id = check(seq, params)
            rows = [logprobs[i]] if logprobs is not None and params.logprobs is not None else None
            update.seqs.append(SeqUpdate(seq.sample_index, [token], rows, reason, stop_token_id))
            if reason is not None:
                seq.status = SequenceStatus.of_reason(reason)
                ended.append(group)
        return StepOutcome(updates, ended, kept)

    def update_from_drafts(
        self,
        items: list[ScheduledSeq],
        token_ids: list[list[int]],
        logprobs: list[list[dict[int, float]]] | None,
        accepted: list[int],
        outcome: StepOutcome,
        accept: TokenFilter | None = None,
    ) -> None:
        """A speculative step's verified tokens, into `outcome`: item i kept `accepted[i]` of its draft tokens
        and `token_ids[i]` (those plus the model's own next one). Each token is appended and stop-checked in
        turn (a stop token or max_tokens inside the run ends it there); the accepted drafts' KV counts as
        computed, the blocks the rejected ones took go back."""
        assert self.speculator is not None
        bm = self.block_manager
        for i, item in enumerate(items):
            seq, group = item.seq, item.group
            if seq.status >= FINISHED or item.draft is None:
                continue
            self.speculator.record(seq, len(item.draft.token_ids), accepted[i])
            update = _update_of(outcome, group)
            rows = logprobs[i] if logprobs is not None and group.sampling_params.logprobs is not None else None
            run = _allowed_run(seq, token_ids[i], accept)
            kept, reason, stop_token_id = self._append_run(seq, group.sampling_params, run)
            if reason is None and len(run) < len(token_ids[i]):  # the grammar allowed no token after `run`
                reason, update.error = "abort", _dead_end_error(seq)
            outcome.num_tokens += kept
            self.fair.charge_output(group.sampling_params.tenant, kept - 1)  # (the step charged its own token)
            update.seqs.append(
                SeqUpdate(seq.sample_index, run[:kept], None if rows is None else rows[:kept], reason, stop_token_id)
            )
            if item.draft.from_prediction:
                update.prediction_tokens += len(item.draft.token_ids)
                update.accepted_prediction_tokens += min(accepted[i], kept)
            if reason is not None:
                seq.status = SequenceStatus.of_reason(reason)
                outcome.ended.append(group)
                continue
            seq.num_computed_tokens += accepted[i]
            bm.truncate(seq, seq.num_tokens)
            if bm.follows_progress:
                bm.mark_computed(seq)

    def _append_run(
        self, seq: Sequence, params: SamplingParams, tokens: list[int]
    ) -> tuple[int, FinishReason | None, int | None]:
        """Appends `tokens` to `seq` up to the first that ends it; returns how many and the stop found."""
        for count, token in enumerate(tokens, 1):
            seq.append_token(token)
            reason, stop_token_id = self.stops.check(seq, params)
            if reason is not None:
                return count, reason, stop_token_id
        return len(tokens), None, None

    def _dead_end(self, seq: Sequence, update: RequestUpdate) -> SeqUpdate:
        """A constrained sequence whose grammar allowed no token (e.g. min_tokens masked the only one
        left): it ends, without the token sampled from nothing, and the request says why."""
        seq.drop_last_token()
        seq.status = _ABORTED
        update.error = _dead_end_error(seq)
        return SeqUpdate(seq.sample_index, [], finish_reason="abort")

    def append_placeholders(self, sampling: list[ScheduledSeq]) -> None:
        """A placeholder for each token of `sampling` still on its way to the host, so that the next step
        schedules its decode. A token that ends its sequence by length gets none, so nothing is scheduled
        for it (a decode of a finished sequence could take a block, preempting a live one)."""
        at_limit = self.stops.at_length_limit
        for item in sampling:
            seq = item.seq
            if not seq.status.finished and not at_limit(seq, item.group.sampling_params, pending=1):
                seq.append_token(PLACEHOLDER)

    def fork_samples(self, forks: list[tuple[ScheduledSeq, list[Sequence]]]) -> list[Sequence]:
        """The prompts that completed in the step just done have their KV written: their samples (made
        beforehand, each drew its first token from its prompt's logits) now share its blocks. A request
        that ended or was preempted meanwhile drops them: returns those."""
        dropped = []
        for item, children in forks:
            parent, group = item.seq, item.group
            live = parent.status is _RUNNING and group.request_id in self._groups
            for child in children:
                if live:
                    self.fork_seq(group, parent, child)
                else:
                    child.status = _ABORTED
                    dropped.append(child)
        return dropped

    def stop_choice(self, group: SequenceGroup, index: int) -> list[SequenceGroup]:
        """Ends the choice `index` of `group` (a stop string ended it) and frees its blocks at once;
        returns the group if that finished it (as `free_finished`)."""
        self.finish_seqs((s for s in group.seqs if s.sample_index == index), SequenceStatus.FINISHED_STOPPED)
        return self.free_finished([group])

    def finish_group(self, group: SequenceGroup, status: SequenceStatus) -> None:
        """Every unfinished sequence of `group` gets the finished `status` (freed by `free_finished`)."""
        self.finish_seqs(group.seqs, status)

    def finish_seqs(self, seqs: Iterable[Sequence], status: SequenceStatus) -> None:
        for seq in seqs:
            if not seq.status.finished:
                seq.status = status

    def free_finished(self, groups: Iterable[SequenceGroup]) -> list[SequenceGroup]:
        """Frees the finished sequences of `groups` (those that just sampled: the only ones that can have
        finished); drops and returns the groups now wholly finished, from whichever queue holds them."""
        bm, finished = self.block_manager, []
        for group in groups:
            for seq in group.seqs:
                if seq.status >= FINISHED and seq.block_table:
                    bm.free(seq)
            if group.finished and self.remove_seq_group(group.request_id) is not None:
                finished.append(group)
        return finished

    # ---- state ----------------------------------------------------------------------------------

    def _rank(self, group: SequenceGroup) -> int:
        return self._arrival[group.request_id]

    def _forget(self, group: SequenceGroup) -> None:
        if self.speculator is not None:
            self.speculator.forget(group)
        self._blocked = None
        self.paused.discard(group.request_id)
        if self._groups.pop(group.request_id, None) is not None:
            self.fair.leave(group)
        self._arrival.pop(group.request_id, None)
        self._lost_tokens.pop(group.request_id, None)

    def has_unfinished_seqs(self) -> bool:
        return bool(self.running or self.waiting or self.swapped)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            self.num_running,
            self.num_waiting,
            self.num_swapped,
            self.preemptions_swap,
            self.preemptions_recompute,
            self.recomputed_tokens,
            len(self.paused),
            self.fair.stats(),
            self.speculator.draft_tokens if self.speculator is not None else 0,
            self.speculator.accepted_tokens if self.speculator is not None else 0,
        )


@dataclass(slots=True)
class _CatchUp:
    """One step's cap (`_catch_up`): the prompt chunks of tenants other than `tenant` share `left` tokens,
    and with `hold_decodes` the decodes of tenants not `spared` wait; `held` counts them."""

    tenant: str
    left: int
    hold_decodes: bool = False
    spared: frozenset[str] = frozenset()  # tenants whose decodes run: `tenant`, those whose first token is due
    held: int = 0

    def holds(self, group: SequenceGroup, rows: int) -> bool:
        """Whether `group`'s `rows` decodes wait this step (counted in `held`)."""
        if not self.hold_decodes or group.sampling_params.tenant in self.spared:
            return False
        self.held += rows
        return True

    def spent_for(self, group: SequenceGroup) -> bool:
        """Whether `group`'s chunk would get nothing of the cap."""
        return self.left <= 0 and group.sampling_params.tenant != self.tenant

    def allow(self, group: SequenceGroup, wanted: int) -> int:
        """The tokens `group`'s chunk may take of the `wanted` ones, counted off the cap (the step's budget
        may cut the chunk further: the cap's leftover is then lost for this step, which only errs short)."""
        if group.sampling_params.tenant == self.tenant:
            return wanted
        allowed = min(wanted, self.left)
        self.left -= allowed
        return allowed


def _computed_tokens(group: SequenceGroup) -> int:
    return sum(seq.num_computed_tokens for seq in group.seqs)


def _prompt_left(seq: Sequence) -> bool:
    return seq.status is _RUNNING and seq.num_tokens - seq.num_computed_tokens > 1


def _has_work(seq: Sequence) -> bool:
    return seq.status is _RUNNING and seq.num_computed_tokens < seq.num_tokens


def _allowed(catch_up: _CatchUp | None, group: SequenceGroup, wanted: int) -> int:
    return wanted if catch_up is None else catch_up.allow(group, wanted)


def _order_class(group: SequenceGroup) -> tuple[int, int]:
    """The part of the admission order that comes before the tenants' counters (`FairShare.key`)."""
    return tier_of(group), group.sampling_params.priority


def _first_tokens(prefills: list[ScheduledSeq]) -> set[str]:
    """The tenants of the prompts that sample their first token in this step."""
    return {item.group.sampling_params.tenant for item in prefills if item.samples and item.seq.num_output_tokens == 0}


@dataclass(slots=True)
class _Skipped:
    """What one step's admission passes over once a group did not fit (fair order): the rest of that
    group's tenant (each tenant's requests keep their arrival order) and, after any group that is not
    `flex`, every `flex` one (it runs only on spare capacity)."""

    tenants: set[str] = field(default_factory=set)
    flex: bool = False
    queued: set[str] | None = None  # the tenants with a waiting group, once one is held back

    def add(self, group: SequenceGroup) -> None:
        self.tenants.add(group.sampling_params.tenant)
        self.flex |= tier_of(group) != FLEX

    def holds(self, group: SequenceGroup) -> bool:
        return group.sampling_params.tenant in self.tenants or (self.flex and tier_of(group) == FLEX)

    def holds_all(self, waiting: Iterable[SequenceGroup]) -> bool:
        """Whether every tenant with a group in `waiting` is held back: then the rest of the queue is too, and
        the step's admission need not walk it (a long queue in overload). Admission only takes groups out of the
        queue (a paused group that a preemption puts back is not admitted)."""
        if self.queued is None:
            self.queued = {group.sampling_params.tenant for group in waiting}
        return self.tenants >= self.queued


def _may_take_seat(group: SequenceGroup, unserved: set[str], paused: set[str]) -> bool:
    """A waiting group of a tenant with nothing running, neither paused nor `flex` (spare capacity only)."""
    params = group.sampling_params
    return params.tenant in unserved and group.request_id not in paused and params.service_tier != "flex"


def _held_back(skip: _Skipped, group: SequenceGroup, waiting: deque[SequenceGroup]) -> bool:
    """`group` waits this step and holds back its own tenant (and flex) behind it; True when that leaves
    nothing else to admit (admission stops)."""
    skip.add(group)
    return skip.holds_all(waiting)


def _dead_end_error(seq: Sequence) -> str:
    return (
        f"structured output reached a dead end after {seq.num_output_tokens} tokens: the grammar "
        "allows no token here (check min_tokens, stop settings and the schema)"
    )


def _allowed_run(seq: Sequence, run: list[int], accept: TokenFilter | None) -> list[int]:
    """A verified run up to the first token `seq`'s grammar refuses (it advances the grammar over the rest;
    the verify step's masks make a refusal a dead end: a row that allowed no token)."""
    if accept is None:
        return run
    for count, token in enumerate(run):
        if not accept(seq, token):
            return run[:count]
    return run


def _update_of(outcome: StepOutcome, group: SequenceGroup) -> RequestUpdate:
    """The request's update in `outcome`, made when it has none yet."""
    update = outcome.updates.get(group.request_id)
    if update is None:
        update = outcome.updates[group.request_id] = RequestUpdate(
            group.request_id, [], group.num_cached_tokens, group.first_scheduled_time
        )
    return update


def _running_parts(group: SequenceGroup) -> tuple[list[Sequence], list[ScheduledSeq]]:
    """The group's running sequences split: those decoding (one token left) and its prompts' chunks (sized
    to the whole rest of the prompt; the step's budget trims them)."""
    writers, prompts = [], []
    for seq in group.seqs:
        if seq.status is not _RUNNING:
            continue
        left = seq.num_tokens - seq.num_computed_tokens
        if left == 1:
            writers.append(seq)
        elif left > 1:
            prompts.append(ScheduledSeq(seq, group, group.prefill_end(seq) - seq.num_computed_tokens))
    return writers, prompts


def _decode_now(group: SequenceGroup, writers: list[Sequence], prompts: list[ScheduledSeq], budget: int) -> bool:
    """Whether the group's decoding sequences run this step: always for parallel samples (as many as the
    budget allows); for beams only all together, once none is still prefilling (a beam search step takes
    every beam's logits at once)."""
    if not group.sampling_params.use_beam_search:
        return True
    return not prompts and len(writers) <= budget
