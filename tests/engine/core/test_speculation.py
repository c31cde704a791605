"""The draft proposers and the acceptance floor (plain Python): what prompt lookup and a prediction propose,
that drafts stop short of max_tokens, and that a sequence whose drafts keep failing stops drafting a while."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from streamd.config import SchedulerConfig, SpeculativeConfig
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.scheduler import Scheduler
from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.core.sequence import PLACEHOLDER, Sequence, SequenceGroup, SequenceStatus
from streamd.engine.core.speculation import (
    DEFAULT_ROW_COST,
    DraftPrice,
    DraftRecord,
    Speculator,
    best_draft_length,
    find_continuation,
)
from streamd.engine.core.step_cost import MAX_SERIAL_OVERHEAD, StepCost, StepPeriods, StepShape
from streamd.engine.sampling_params import SamplingParams


def _group(prompt: list[int], output: list[int], prediction: list[int] = (), **params) -> SequenceGroup:
    seq = Sequence(prompt_token_ids=list(prompt))
    for token in output:
        seq.append_token(token)
    if output:  # decoding: every token but its last has KV
        seq.num_computed_tokens = seq.num_tokens - 1
    group = SequenceGroup("r", [seq], SamplingParams(temperature=0, **params))
    group.prediction_token_ids = list(prediction)
    return group


def test_prompt_lookup_follows_its_last_match_forward() -> None:
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert find_continuation(tokens, tokens, 3, 2) == 9  # no match before: the latest earlier occurrence
    assert find_continuation(tokens, tokens, 3, 2, after=0) == 3  # the first one at or after the last match
    assert find_continuation(tokens, tokens, 3, 2, after=4) == 9
    alone = [5, 6, 7]
    assert find_continuation(alone, alone, 3, 1) is None  # only the tail itself
    assert find_continuation([4, 4], [9, 4, 4, 1], 2, 1) == 3


def test_a_prediction_drafts_from_its_start_then_where_the_output_left_it() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=3), max_model_len=100)
    prediction = [10, 11, 12, 13, 14, 15, 16]
    fresh = _group([1, 2], [], prediction, max_tokens=50)
    assert spec.propose(fresh.seqs[0], fresh, 8).token_ids == [10, 11, 12]
    edited = _group([1, 2], [10, 11, 99, 13], prediction, max_tokens=50)  # an edit, then back on the text
    draft = spec.propose(edited.seqs[0], edited, 8)
    assert draft.token_ids == [14, 15, 16] and draft.from_prediction
    unrelated = _group([1, 2], [50, 51], prediction, max_tokens=50)
    assert spec.propose(unrelated.seqs[0], unrelated, 8) is None  # prompt lookup is off


def test_drafts_stop_short_of_max_tokens_and_the_budget() -> None:
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=8), max_model_len=100)
    group = _group([1], [10], list(range(10, 40)), max_tokens=5)
    assert len(spec.propose(group.seqs[0], group, 8).token_ids) == 3  # 1 + 3 drafts + the model's own = 5
    assert len(spec.propose(group.seqs[0], group, 2).token_ids) == 2
    last = _group([1], [10, 11, 12, 13], list(range(10, 40)), max_tokens=5)
    assert spec.propose(last.seqs[0], last, 8) is None


def test_a_sequence_drafts_fewer_tokens_while_its_drafts_are_refused_and_more_as_they_are_kept() -> None:
    """The draft length follows the recent acceptance rate r (`best_draft_length`, rows priced as on a GPU): a
    refused draft shrinks the next, kept ones grow it back."""
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=8, min_acceptance=0.0), max_model_len=200)
    group = _group([1], [10], list(range(10, 100)), max_tokens=150)
    seq = group.seqs[0]
    lengths = []
    for accepted_share in (0.0,) * 5 + (1.0,) * 5:
        drafted = len(spec.propose(seq, group, 8).token_ids)
        lengths.append(drafted)
        spec.record(seq, drafted, round(drafted * accepted_share))
    assert lengths[0] == best_draft_length(0.7, DEFAULT_ROW_COST, 8) == 6  # no history: a hopeful rate
    assert lengths[:5] == sorted(lengths[:5], reverse=True) and lengths[1] < 6 and lengths[4] == 1  # refused
    assert lengths[5:] == sorted(lengths[5:]) and lengths[-1] > 2  # kept: growing again


def test_failing_drafts_pause_a_sequence_longer_after_each_relapse() -> None:
    spec = Speculator(SpeculativeConfig(prompt_lookup=True, min_acceptance=0.5), max_model_len=100)
    group = _group([1, 2, 3, 1, 2], [3], max_tokens=50)
    seq = group.seqs[0]
    assert spec.propose(seq, group, 8) is not None
    pauses = []
    for _ in range(2):
        while spec.propose(seq, group, 8) is not None:
            spec.record(seq, 4, 0)
        skipped = 0
        while spec.propose(seq, group, 8) is None:
            skipped += 1
        pauses.append(skipped)
    assert pauses[0] >= 1 and pauses[1] > pauses[0]
    assert spec.draft_tokens > 0 and spec.accepted_tokens == 0


def test_requests_whose_sampling_reads_their_history_never_draft() -> None:
    spec = Speculator(SpeculativeConfig(prompt_lookup=True), max_model_len=100)
    for params in ({"repetition_penalty": 1.2}, {"seed": 1, "temperature": 0.5}, {"min_tokens": 5}):
        group = _group([1, 2, 3, 1, 2], [3], max_tokens=50)
        group.sampling_params = SamplingParams(max_tokens=50, **params)
        assert spec.propose(group.seqs[0], group, 8) is None, params


def test_the_overlap_stays_on_unless_a_running_sequence_may_draft() -> None:
    """`may_speculate` (False: the engine keeps the step overlapped) counts running sequences, not groups,
    and a sequence pausing after failed drafts does not turn the overlap off."""
    spec = Speculator(SpeculativeConfig(prompt_lookup=True, min_acceptance=0.5, disable_by_batch_size=2), 100)
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), 100, speculator=spec)
    group = _group([1, 2, 3, 1, 2], [3], max_tokens=50)
    group.seqs[0].status = SequenceStatus.RUNNING
    sched.running.append(group)
    assert sched.may_speculate()
    for _ in range(2):  # every draft refused: its acceptance rate falls under the floor, it pauses
        spec.record(group.seqs[0], 4, 0)
    assert not sched.may_speculate()
    while spec.propose(group.seqs[0], group, 8) is None:  # the pause runs out (one step each)
        pass
    assert sched.may_speculate()
    twins = _group([5, 6, 7, 5, 6], [7], max_tokens=50)
    twins.seqs.append(twins.seqs[0].fork())
    for seq in twins.seqs:
        seq.status = SequenceStatus.RUNNING
    sched.running.append(twins)  # two groups, three sequences: past the cut-off
    assert not sched.may_speculate()


def test_a_sequence_with_no_room_for_a_draft_keeps_the_overlap_on() -> None:
    """`may_draft` asks what `propose` asks: a sequence one token short of `max_tokens` has no room for a
    draft, so it must not turn the overlap off for a step that drafts nothing."""
    spec = Speculator(SpeculativeConfig(prompt_lookup=True), 100)
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), 100, speculator=spec)
    group = _group([1, 2, 3, 1, 2], [3], max_tokens=2)
    group.seqs[0].status = SequenceStatus.RUNNING
    sched.running.append(group)
    assert spec.propose(group.seqs[0], group, 8) is None
    assert not sched.may_speculate()


class _Source:
    """A `DraftSource` that records what it was asked and proposes `tokens`."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.asked, self.forgotten = tokens, [], []

    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]:
        self.asked.append((seq_id, list(token_ids), limit))
        return self.tokens[:limit]

    def forget(self, seq_id: int) -> None:
        self.forgotten.append(seq_id)


def test_a_draft_source_drafts_only_where_the_prediction_and_lookup_have_nothing() -> None:
    source = _Source([70, 71, 72, 73])
    spec = Speculator(SpeculativeConfig(prompt_lookup=True, num_speculative_tokens=3), 100, source)
    predicted = _group([1, 2], [], [10, 11, 12], max_tokens=50)
    assert spec.propose(predicted.seqs[0], predicted, 8).token_ids == [10, 11, 12]
    repeating = _group([1, 2, 3, 1, 2], [3], max_tokens=50)
    assert spec.propose(repeating.seqs[0], repeating, 8).token_ids == [1, 2, 3]
    assert source.asked == []
    fresh = _group([4, 5, 6], [7], max_tokens=3)  # room for one draft: 1 output + 1 draft + the model's own
    seq = fresh.seqs[0]
    draft = spec.propose(seq, fresh, 8)
    assert (draft.token_ids, draft.from_prediction) == ([70], False)
    assert source.asked == [(seq.seq_id, [4, 5, 6, 7], 1)]


def test_a_draft_source_alone_makes_a_request_want_drafts_and_forgets_it_when_it_ends() -> None:
    source = _Source([70])
    spec = Speculator(SpeculativeConfig(), 100, source)
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), 100, speculator=spec)
    group = _group([4, 5, 6], [7], max_tokens=50)
    group.seqs.append(group.seqs[0].fork())
    assert spec.wants(group) and not Speculator(SpeculativeConfig(), 100).wants(group)
    spec.preempted(group)
    assert source.forgotten == [s.seq_id for s in group.seqs]
    sched.add_seq_group(group)
    sched.abort_seq_group("r")
    assert source.forgotten == 2 * [s.seq_id for s in group.seqs]


def _tokens_per_step_time(rate: float, row_cost: float, k: int, others: int = 0, serial: float = 0.0) -> float:
    """Expected tokens of a step with a k-draft verify over its time, summed term by term: one token of each other
    sequence, the model's own token always, the i-th draft with probability rate^i (every one before it kept); a
    step that drafts also pays `serial` once (the overlap it gives up), a plain step does not."""
    return (others + sum(rate**i for i in range(k + 1))) / (1 + (serial if k else 0.0) + row_cost * k)


@given(st.floats(0.0, 1.0), st.floats(0.0, 2.0), st.integers(1, 12), st.integers(0, 40), st.floats(0.0, 1.5))
def test_the_draft_length_buys_the_step_the_most_tokens_per_unit_of_time(
    rate: float, row_cost: float, most: int, others: int, serial: float
) -> None:
    k = best_draft_length(rate, row_cost, most, others, serial)
    best = max(_tokens_per_step_time(rate, row_cost, j, others, serial) for j in range(most + 1))
    assert 0 <= k <= most
    assert _tokens_per_step_time(rate, row_cost, k, others, serial) >= best * (1 - 1e-6)
    assert k == 0 or _tokens_per_step_time(rate, row_cost, k, others, serial) > others + 1.0  # beats the decodes
    assert k >= best_draft_length(rate, row_cost, most, others + 1, serial)  # more sequences slowed: never more
    # a dearer lost overlap never starts drafts (it may lengthen them: a fixed cost spread over more tokens)
    assert k > 0 or best_draft_length(rate, row_cost, most, others, serial + 0.1) == 0


def test_a_lost_overlap_stops_drafts_that_fail_and_keeps_those_that_hold() -> None:
    """The H200's default model (benchmarks/NOTES.md, issue 34): rows nearly free, but a step that drafts takes
    ~1.45 of an overlapped one. Chat's drafts (~10% kept) then lose and stop; an edit's (~80% kept) still pay."""
    assert best_draft_length(0.1, 0.01, 8) > 0 and best_draft_length(0.1, 0.01, 8, serial=0.45) == 0
    assert best_draft_length(0.8, 0.01, 8, serial=0.45) == 8


def test_step_periods_give_what_a_drafting_step_loses_beyond_its_rows() -> None:
    periods = StepPeriods()
    assert periods.serial_overhead() == 0.0
    for _ in range(40):
        periods.observe(0.0015, overlapped=False, rows_share=0.05)
    assert periods.serial_overhead() == 0.0  # no overlapped step to compare with (the CPU's steps never overlap)
    for seconds in (0.0009, 0.0011) * 20:
        periods.observe(seconds, overlapped=True, rows_share=0.0)
    assert abs(periods.serial_overhead() - 0.45) < 0.03  # 1.5 / ~1.0 - 1 - 0.05
    for _ in range(40):
        periods.observe(0.0009, overlapped=False, rows_share=0.0)
    assert periods.serial_overhead() == 0.0  # never below nothing
    periods.observe(0.05, overlapped=False, rows_share=0.0)
    # never so dear that a kept probe would not pay: probes keep measuring, so a bad estimate mends itself
    assert periods.serial_overhead() == MAX_SERIAL_OVERHEAD and best_draft_length(1.0, 0.05, 1, 0, MAX_SERIAL_OVERHEAD)


def test_drafts_shrink_where_a_row_costs_what_it_does_on_a_cpu() -> None:
    """A 2-core CPU (benchmarks/NOTES.md, issue 29): a verify row ~0.46 of a decode step. Half-kept drafts
    pay for one draft at most; a batched GPU forward (rows ~free) takes the most at a rate that fails there."""
    assert [best_draft_length(rate, 0.46, 8) for rate in (0.3, 0.5, 0.8, 0.95, 1.0)] == [0, 1, 2, 5, 8]
    assert best_draft_length(0.7, 0.02, 8) >= 6
    assert best_draft_length(1.0, 1.0, 8) == 0  # a row as dear as a step: drafts can only break even
    # a second sequence in the step: its token is slowed too, so a draft must gain twice as much
    assert best_draft_length(0.5, 0.3, 8) == 1 and best_draft_length(0.5, 0.3, 8, others=1) == 0


def test_a_sequence_whose_drafts_do_not_pay_pauses_then_probes_with_one_draft() -> None:
    spec = Speculator(SpeculativeConfig(prompt_lookup=True, min_acceptance=0.0), max_model_len=200)
    group = _group([1, 2, 3, 1, 2, 3, 1, 2], [3], max_tokens=100)
    seq = group.seqs[0]
    assert len(spec.propose(seq, group, 8, DraftPrice(0.46)).token_ids) == 1  # no history: a hopeful 0.7
    for _ in range(2):
        spec.record(seq, 1, 0)  # refused: the rate falls to ~0.34, where no draft pays at this row cost
    skipped = 0
    while (draft := spec.propose(seq, group, 8, DraftPrice(0.46))) is None:
        skipped += 1
    assert skipped >= 2 and len(draft.token_ids) == 1  # the pause, then a probe of one draft


def test_the_step_cost_prices_a_draft_row_from_the_steps_it_measured() -> None:
    """Steps without prompt chunks measured at 5 ms + 4.4 ms a token: one more row of a one-row step costs
    4.4 / 9.4 of it. Before any such step there is no price (the speculator then assumes a GPU's)."""
    cost = StepCost(seconds_per_token=0.001)
    assert cost.row_cost(1) is None
    for tokens in (1, 1, 2, 3, 1, 5, 9):
        cost.observe(StepShape(tokens=tokens), 0.005 + 0.0044 * tokens)
    assert abs(cost.row_cost(1) - 4.4 / 9.4) < 0.03  # (the fit is pulled lightly toward its prior)
    assert cost.row_cost(4) < cost.row_cost(1)


def test_a_step_prices_draft_rows_once_and_only_where_a_sequence_may_draft(monkeypatch) -> None:
    """The step cost is fitted for a draft row's price only in a step with a sequence that wants drafts (a
    prediction here), once however many do: a small model's GPU step is ~1 ms, a fit is tens of microseconds."""
    spec = Speculator(SpeculativeConfig(), 100)  # no prompt lookup, no draft model: only predictions draft
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), 100, speculator=spec)
    asked: list[int] = []
    monkeypatch.setattr(sched.step_cost, "row_cost", lambda tokens: asked.append(tokens) or 0.1)
    plain = [ScheduledSeq(g.seqs[0], g, 1) for g in (_group([1, 2, 3], [4]), _group([5, 6], [7]))]
    assert sched._add_drafts(SchedulerOutput(), plain, 64) == 0 and asked == []
    predicted = [_group([1, 2, 3], [4], [4, 5, 6, 7, 8], max_tokens=50) for _ in range(2)]
    sched._add_drafts(SchedulerOutput(), plain + [ScheduledSeq(g.seqs[0], g, 1) for g in predicted], 64)
    assert asked == [4]  # one price for the step's four decodes


def test_a_draft_must_pay_for_every_sequence_its_rows_slow(monkeypatch) -> None:
    """Priced at 0.3 of the step a row, a fresh sequence (a hopeful rate of 0.7) drafts two tokens when it decodes
    alone; beside three other decodes its rows would slow four tokens, and no draft gains that much."""
    def drafts(plain: int) -> int:
        spec = Speculator(SpeculativeConfig(), 100)
        sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), 100, speculator=spec)
        monkeypatch.setattr(sched.step_cost, "row_cost", lambda tokens: 0.3)
        predicted = _group([1, 2, 3], [4], [4, 5, 6, 7, 8], max_tokens=50)
        others = [ScheduledSeq(g.seqs[0], g, 1) for g in (_group([9, 8], [7]) for _ in range(plain))]
        return sched._add_drafts(SchedulerOutput(), [ScheduledSeq(predicted.seqs[0], predicted, 1), *others], 64)

    assert drafts(0) == 2 and drafts(3) == 0


def test_a_crowded_step_skips_drafts_without_pausing_the_sequence() -> None:
    """Where only the step's other decodes make drafts a loss, the sequence's record is left as it was: no pause,
    no relapse, so the first step it decodes alone it drafts again."""
    spec = Speculator(SpeculativeConfig(prompt_lookup=True, min_acceptance=0.0), max_model_len=400)
    group = _group([1, 2, 3, 1, 2, 3, 1, 2], [3], max_tokens=300)
    seq = group.seqs[0]
    for _ in range(150):
        assert spec.propose(seq, group, 8, DraftPrice(0.3), others=3) is None
    record = spec._records[seq.seq_id]
    assert record.paused_steps == 0 and record.relapses == 0 and not record.probe
    assert len(spec.propose(seq, group, 8, DraftPrice(0.3)).token_ids) == 2


def test_a_scheduler_without_a_latency_budget_still_learns_a_draft_rows_price() -> None:
    """`scheduler.max_step_ms = 0` turns the step budget off, not the step cost: speculation reads its fit."""
    sched = Scheduler(SchedulerConfig(max_step_ms=0.0), BlockManager(64, 4), 100, speculator=Speculator(SpeculativeConfig(), 100))
    assert sched.step_cost.row_cost(1) is None
    for tokens in (1, 2, 1, 3):
        out = SchedulerOutput()
        out.shape.tokens = tokens
        sched.observe_step(out, 0.005 + 0.002 * tokens)
    assert sched.step_cost.row_cost(1) is not None


def test_the_engine_keeps_its_overlap_where_no_draft_would_pay() -> None:
    """`may_draft` is what the engine asks before it gives up the step's overlap: false where this step's price
    (its other decodes, its lost overlap) makes every draft a loss, and asking changes nothing."""
    spec = Speculator(SpeculativeConfig(prompt_lookup=True, min_acceptance=0.0), max_model_len=400)
    group = _group([1, 2, 3, 1, 2, 3, 1, 2], [3], max_tokens=300)
    seq = group.seqs[0]
    assert spec.may_draft(seq, group, DraftPrice(0.3))
    assert not spec.may_draft(seq, group, DraftPrice(0.3), others=3)
    assert not spec.may_draft(seq, group, DraftPrice(0.01, serial=9.0))
    assert spec._records == {}
    assert len(spec.propose(seq, group, 8, DraftPrice(0.3)).token_ids) == 2


def test_a_copy_that_holds_then_breaks_rates_as_a_run_not_as_a_share() -> None:
    """The rate is a geometric run's: kept drafts over kept drafts and breaks. Eight-draft verifies that keep 3, 8, 8
    and 5 drafts (a copy breaking twice) rate ~0.9, though only 75% of the drafts were kept; verifies that keep
    nothing rate near 0."""
    copy, chat = DraftRecord(), DraftRecord()
    for accepted in (3, 8, 8, 5) * 3:
        copy.verified(8, accepted)
        chat.verified(8, 0)
    assert copy.rate > 0.85 and chat.rate < 0.05
    assert best_draft_length(copy.rate, 0.01, 8, serial=0.45) == 8 and best_draft_length(chat.rate, 0.01, 8) == 0


def test_step_periods_learn_only_between_decode_steps_few_enough_to_draft() -> None:
    """A serial step waits first for the step before it: after a prompt chunk that is the chunk's device time, no
    decode step's (on the H200 one such period priced every draft out). Steps of more decodes than speculation
    drafts beside (`disable_by_batch_size`) are another regime and teach nothing either; a serial period's draft rows
    are those of the step it waited for."""
    sched = Scheduler(SchedulerConfig(), BlockManager(64, 4), 100, speculator=Speculator(SpeculativeConfig(), 100))
    periods = sched.step_periods

    def plan(decodes: int, drafts: int = 0, chunk: bool = False) -> SchedulerOutput:
        out = SchedulerOutput(num_decode_tokens=decodes, num_draft_tokens=drafts)
        if chunk:
            out.shape.add_chunk(800, 0)
        return out

    sched.observe_period(plan(1), 0.010, overlapped=False, waited=plan(0, chunk=True))
    sched.observe_period(plan(256), 0.003, overlapped=True, waited=plan(256))
    sched.observe_period(plan(1, chunk=True), 0.003, overlapped=True, waited=plan(1))
    assert periods.serial is None and periods.overlapped is None
    sched.observe_period(plan(1), 0.001, overlapped=True, waited=plan(1))
    sched.observe_period(plan(1), 0.0015, overlapped=False, waited=plan(1, drafts=8))
    assert periods.serial == 0.0015 and periods.serial_rows > 0  # the rows of the verify it waited for


def test_may_draft_changes_no_record_and_a_probe_survives_an_overlapped_step() -> None:
    spec = Speculator(SpeculativeConfig(prompt_lookup=True, min_acceptance=0.0), max_model_len=400)
    group = _group([1, 2, 3, 1, 2, 3, 1, 2], [3], max_tokens=300)
    seq = group.seqs[0]
    record = spec._records[seq.seq_id] = DraftRecord(kept=0.1, breaks=0.9, paused_steps=2)
    assert not spec.may_draft(seq, group, DraftPrice(0.3)) and record.paused_steps == 2  # pausing: no
    record.paused_steps, record.probe = 0, True
    # a probe is priced without the lost overlap (it is how a wrong estimate of it gets measured again)
    assert spec.may_draft(seq, group, DraftPrice(0.01, serial=0.75), others=1) and record.probe
    seq.token_ids.append(PLACEHOLDER)  # an overlapped step: its last token is still on the device
    assert spec.propose(seq, group, 8, DraftPrice(0.01)) is None and record.probe
    seq.token_ids[-1] = 1
    assert len(spec.propose(seq, group, 8, DraftPrice(0.01)).token_ids) == 1 and not record.probe


def test_the_step_cost_refits_after_eight_decode_steps_and_after_any_prompt_chunk() -> None:
    """Each of the first eight decode-only steps refits (a price from one or two is poor), then every eighth; a step
    with a prompt chunk refits at once (the chunk sizes follow its cost)."""
    cost = StepCost(seconds_per_token=0.001)
    fits = []
    for tokens in range(1, 9):
        cost.observe(StepShape(tokens=tokens), 0.002 + 0.004 * tokens + 0.0003 * (tokens % 3))
        fits.append(cost.row_cost(1))
    assert len(set(fits)) == len(fits)  # every one of the first eight moved the fit
    first = fits[-1]
    for tokens in (2, 3, 4, 5, 6, 7, 8):
        cost.observe(StepShape(tokens=tokens), 0.002 + 0.005 * tokens)
        assert cost.row_cost(1) == first  # then the fit waits for eight
    cost.observe(StepShape(tokens=9), 0.047)
    assert cost.row_cost(1) != first
    refitted = cost.row_cost(1)
    chunk = StepShape(tokens=1)
    chunk.add_chunk(64, 0)
    cost.observe(chunk, 0.5)
    assert cost.row_cost(1) != refitted  # a prompt chunk's cost is what the chunk sizes follow: at once
