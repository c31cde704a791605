"""Speculation: which draft tokens a decoding sequence proposes this step, and when it stops proposing.

Speculative decoding runs k draft tokens after a sequence's last token through the model in one forward
(a k+1-token query over its cached blocks) and keeps the longest prefix the model agrees with plus one
token of its own (`engine/sample/speculative.py` decides the agreement). Drafts cost a wider forward, so
they must be cheap to propose and likely to be right. Three proposers, asked in this order (the first
that proposes anything drafts the step):

- the request's `prediction` (OpenAI's Predicted Outputs: the text the client expects, e.g. the file
  being edited): before any output its first tokens, then what follows the output's tail where that tail
  occurs in the prediction (searched from where the last match left off, so an edit realigns);
- prompt lookup (`speculative.prompt_lookup`): what followed an earlier occurrence of the output's last n
  tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in the prompt and output so far: the first
  one at or after where the last match ended (a copy follows its source forward), else the latest;
- a draft model (`speculative.draft_model`), through the `DraftSource` interface (the torch side,
  `engine/worker/draft_model.py`, is injected by the builder): a smaller model's greedy continuation.

Why this order: the client's prediction is what it says the output is, and costs nothing; a lookup match
costs nothing either and, where the text copies itself, is as likely right as a model; the draft model
costs k forwards of its own, so it drafts only where neither of the free proposers has anything. (A draft
source keeps state per sequence, its cache; it catches up on the tokens the other proposers drafted the
next time it is asked.)

How many drafts: the number that buys the step the most tokens per second (`best_draft_length`), from the
sequence's rate (the chance a draft is kept once those before it were, estimated as a geometric run's: kept drafts
over kept drafts and breaks), the step's `DraftPrice` (what a draft row costs against the step without it, which
the scheduler reads off its fitted step cost: ~0.46 of a one-sequence decode step on a 2-core CPU, about 1% in a
GPU's decode graph; and what the step loses by giving up the overlap of host and device, `StepPeriods`: ~0.45 of a
step for a 135M model on an H200, 0 on the CPU) and how many other sequences the step decodes (the draft rows slow
their tokens too). Where no draft length beats a plain decode, the sequence pauses, then probes with one draft;
one whose rate falls below `min_acceptance` stops drafting for a while too (longer after each relapse); a step with
more decoding sequences than `disable_by_batch_size` does not speculate at all (the wider forward stops paying).
Requests whose sampling reads per-position state (penalties, seeds, beam search, a thinking budget, pending
`min_tokens`) never speculate: their output stays exactly as without speculation. A structured output does
speculate: each verify row is masked by its grammar's state after the drafts before it
(`GrammarMatchers.draft_bitmask`). Plain Python: the scheduler owns one `Speculator`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from streamd.config import SpeculativeConfig
from streamd.engine.core.sequence import PLACEHOLDER, Sequence, SequenceGroup
from streamd.engine.sampling_params import SamplingParams

_RATE_WEIGHT = 0.3  # weight of the newest step in a sequence's acceptance rate (exponential average)
DEFAULT_ROW_COST = 0.05  # a draft row's cost against its step where none was measured (a GPU's batched forward)


@dataclass(frozen=True, slots=True)
class DraftPrice:
    """What drafting adds to a step, as shares of the step without drafts: `row` per draft row (`StepCost.row_cost`),
    `serial` once for the overlap the step gives up (`StepPeriods.serial_overhead`)."""

    row: float = DEFAULT_ROW_COST
    serial: float = 0.0


_BASE_PAUSE_STEPS = 8  # steps a sequence below the floor stops drafting, doubled per relapse
_MAX_PAUSE_STEPS = 256


@dataclass(slots=True)
class Draft:
    """Draft tokens proposed for one sequence in one step, and whether they came from its prediction."""

    token_ids: list[int]
    from_prediction: bool = False


@dataclass(slots=True)
class DraftRecord:
    """One sequence's speculation history: its recent acceptance rate and its pause."""

    # The chance that a draft is kept once those before it were, estimated as a geometric run's: kept drafts over
    # kept drafts and breaks (a verify that refused one), each a running mean per verify. A copy that holds for
    # eight drafts and then breaks rates 8 / 9, where the share kept of everything drafted (a copy of three
    # tokens in eight drafts, 3 / 8) would price drafts as if every position were a coin toss. Before any
    # verify: 0.7, hopeful, yet one draft where a row is dear (a CPU), ~6 where cheap.
    kept: float = 0.7
    breaks: float = 0.3
    paused_steps: int = 0
    relapses: int = 0
    probe: bool = False  # the next draft, after a pause for drafts not paying, is one token: its acceptance is news
    cursor: int = 0  # where the last match in the prediction ended
    lookup_cursor: int = 0  # where the last prompt-lookup match ended (a copy follows its source forward)

    @property
    def rate(self) -> float:
        # (kept + breaks starts at 1 and stays at least 1: each verify keeps a draft or breaks, or both)
        return self.kept / (self.kept + self.breaks)

    def verified(self, drafted: int, accepted: int) -> None:
        self.kept += _RATE_WEIGHT * (accepted - self.kept)
        self.breaks += _RATE_WEIGHT * (float(accepted < drafted) - self.breaks)

    def reset_rate(self, rate: float) -> None:
        self.kept, self.breaks = rate, 1.0 - rate


class DraftSource(Protocol):
    """A proposer that keeps state per sequence (a draft model's cache): up to `limit` tokens likely to follow
    `token_ids` (the sequence's whole prompt and output); `forget` drops what it keeps for the sequence."""

    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]: ...

    def forget(self, seq_id: int) -> None: ...


def can_speculate(params: SamplingParams) -> bool:
    """Whether drafts can be verified without changing what the request samples (context-free sampling)."""
    return not (
        params.use_beam_search
        or params.uses_penalties
        or params.seed is not None
        or params.thinking_token_budget is not None
    )


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft_source: DraftSource | None = None) -> None:
        """`draft_source`: the draft model (`speculative.draft_model`), asked where no free proposer drafts."""
        self.config = config
        self.max_model_len = max_model_len
        self.draft_source = draft_source
        self._records: dict[int, DraftRecord] = {}  # seq_id -> its history
        self.draft_tokens = 0  # cumulative draft tokens verified
        self.accepted_tokens = 0  # cumulative draft tokens accepted

    def wants(self, group: SequenceGroup) -> bool:
        """Whether `group` may draft at all (a prediction, prompt lookup on or a draft model, and context-free
        sampling)."""
        proposes = self.config.prompt_lookup or self.draft_source is not None or bool(group.prediction_token_ids)
        return proposes and can_speculate(group.sampling_params)

    def step_allowed(self, num_decodes: int) -> bool:
        return 0 < num_decodes <= self.config.disable_by_batch_size

    def may_draft(self, seq: Sequence, group: SequenceGroup, price: DraftPrice = DraftPrice(), others: int = 0) -> bool:
        """Whether `propose` may draft for `seq` next step at `price` beside `others` decodes: `_eligible`, not
        pausing, and some draft length pays (nothing is changed: the engine asks before it gives up the overlap)."""
        record = self._records.get(seq.seq_id)
        if not self._eligible(seq, group) or (record is not None and record.paused_steps):
            return False
        return bool(self._draft_length(record or DraftRecord(), price, others))

    def _eligible(self, seq: Sequence, group: SequenceGroup) -> bool:
        """It wants drafts, has produced its `min_tokens`, and has room for one before its length limit."""
        params = group.sampling_params
        return self.wants(group) and seq.num_output_tokens >= params.min_tokens and self._room(seq, params) > 0

    def propose(
        self,
        seq: Sequence,
        group: SequenceGroup,
        limit: int,
        price: DraftPrice = DraftPrice(),
        others: int = 0,
    ) -> Draft | None:
        """`seq`'s drafts for this step (at most `limit` tokens), or None; `price`: what drafting adds to the step,
        as shares of the step without drafts, which also decodes `others` sequences."""
        if not self._eligible(seq, group):
            return None
        record = self._records.setdefault(seq.seq_id, DraftRecord())
        if record.paused_steps:
            record.paused_steps -= 1
            return None
        k = self._draft_length(record, price, others)
        if k is None:  # drafts would pay alone, not beside this step's other decodes: this step only
            return None
        if k == 0:  # no draft pays at this rate: wait, then probe with one
            self._pause(record)
            record.probe = True
            return None
        if seq.token_ids[-1] == PLACEHOLDER:  # an overlapped step: nothing to continue yet (a probe waits)
            return None
        record.probe = False
        k = min(limit, k, self._room(seq, group.sampling_params))
        if k <= 0:
            return None
        return (
            self._from_prediction(seq, group, record, k)
            or self._from_lookup(seq, record, k)
            or self._from_draft_source(seq, k)
        )

    def _draft_length(self, record: DraftRecord, price: DraftPrice, others: int) -> int | None:
        """`best_draft_length` at the sequence's rate: 0 where no draft pays even alone (a bad rate: the caller
        pauses it); None where the step's `others` decodes alone make every draft a loss (the record untouched, a
        pending probe kept); one after a pause (a probe), where a kept draft would pay in this step."""
        most, row, serial = self.config.num_speculative_tokens, price.row, price.serial
        if record.probe:  # (priced without the lost overlap: a probe is how a wrong estimate of it is mended)
            return 1 if best_draft_length(1.0, row, 1, others) else None
        alone = best_draft_length(record.rate, row, most, 0, serial)
        if alone == 0 or others == 0:
            return alone
        return best_draft_length(record.rate, row, most, others, serial) or None

    def _room(self, seq: Sequence, params: SamplingParams) -> int:
        """Drafts that can still become output: the token after them is the step's own (max_tokens, context)."""
        room = self.max_model_len - seq.num_tokens - 1
        if params.max_tokens is not None:
            room = min(room, params.max_tokens - seq.num_output_tokens - 1)
        return room

    def _from_prediction(self, seq: Sequence, group: SequenceGroup, record: DraftRecord, k: int) -> Draft | None:
        prediction = group.prediction_token_ids
        if not prediction:
            return None
        output = seq.output_token_ids
        if not output:
            return Draft(prediction[:k], from_prediction=True)
        start = find_continuation(output, prediction, self.config.prompt_lookup_max, 1, record.cursor)
        if start is None:
            return None
        record.cursor = start
        tokens = prediction[start : start + k]
        return Draft(tokens, from_prediction=True) if tokens else None

    def _from_lookup(self, seq: Sequence, record: DraftRecord, k: int) -> Draft | None:
        if not self.config.prompt_lookup:
            return None
        tokens, config = seq.token_ids, self.config
        start = find_continuation(
            tokens, tokens, config.prompt_lookup_max, config.prompt_lookup_min, record.lookup_cursor
        )
        if start is None:
            return None
        record.lookup_cursor = start
        return Draft(tokens[start : start + k])

    def _from_draft_source(self, seq: Sequence, k: int) -> Draft | None:
        if self.draft_source is None:
            return None
        tokens = self.draft_source.propose(seq.seq_id, seq.token_ids, k)
        return Draft(tokens) if tokens else None

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verified draft of `seq`: `accepted` of its `drafted` tokens were kept."""
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        record = self._records.setdefault(seq.seq_id, DraftRecord())
        record.verified(drafted, accepted)
        if record.rate < self.config.min_acceptance:
            self._pause(record)
            record.reset_rate(self.config.min_acceptance)  # one more bad step after the pause stops it again

    @staticmethod
    def _pause(record: DraftRecord) -> None:
        """No drafts for a while, twice as long as the last time."""
        record.paused_steps = min(_BASE_PAUSE_STEPS << record.relapses, _MAX_PAUSE_STEPS)
        record.relapses += 1

    def forget(self, group: SequenceGroup) -> None:
        """`group` ended (finished, aborted, rejected): its records and its draft source's state go."""
        for seq in group.seqs:
            self._records.pop(seq.seq_id, None)
        self.preempted(group)

    def preempted(self, group: SequenceGroup) -> None:
        """`group` gave up its KV (swapped or to be recomputed): the draft source's state of it goes too (it
        is built again from the sequence's tokens if the group drafts after it resumes)."""
        if self.draft_source is not None:
            for seq in group.seqs:
                self.draft_source.forget(seq.seq_id)


def best_draft_length(rate: float, row_cost: float, most: int, others: int = 0, serial: float = 0.0) -> int:
    """The draft count k (0 .. `most`) that buys the step the most tokens per unit of its time, each draft taken
    as kept with probability `rate` once those before it were: k drafts yield (1 - rate^(k+1)) / (1 - rate) tokens
    on average (the kept run, then the model's own token) for 1 + `serial` + `row_cost` * k of the plain step's
    time, `serial` being what a step that drafts loses by not overlapping the host's work (`StepPeriods`). The
    step also decodes `others` sequences, one token each, which the draft rows slow down as well: with B
    sequences a draft must gain B times what it would alone. 0 where no k beats the plain step."""
    rate = min(max(rate, 0.0), 1.0)
    best, best_yield = 0, others + 1.0
    for k in range(1, most + 1):
        tokens = k + 1.0 if rate >= 1.0 else (1.0 - rate ** (k + 1)) / (1.0 - rate)
        per_time = (others + tokens) / (1.0 + serial + row_cost * k)
        if per_time > best_yield * (1.0 + 1e-9):
            best, best_yield = k, per_time
    return best


def find_continuation(
    history: list[int], source: list[int], n_max: int, n_min: int, after: int | None = None
) -> int | None:
    """Where in `source` the continuation of `history`'s last n tokens starts (the longest n from `n_max`
    down to `n_min` that occurs): the first occurrence ending at or after `after` if given, else the latest
    one. When `source` is `history` itself, the tail's own place does not count."""
    same = source is history
    for n in range(min(n_max, len(history) - same), n_min - 1, -1):
        tail = history[-n:]
        end = len(source) - 1 if same else len(source)  # an occurrence must leave a token to propose
        found = _occurrences(source, tail, end)
        if found:
            later = [i for i in found if i + n >= after] if after is not None else []
            return (later[0] if later else found[-1]) + n
    return None


def _occurrences(source: list[int], tail: list[int], end: int) -> list[int]:
    """Starts of `tail` in `source` that end before `end`, in order."""
    first, n, found = tail[0], len(tail), []
    i = _index(source, first, 0, end - n + 1)
    while i is not None:
        if source[i : i + n] == tail:
            found.append(i)
        i = _index(source, first, i + 1, end - n + 1)
    return found


def _index(source: list[int], value: int, start: int, stop: int) -> int | None:
    if start >= stop:
        return None
    try:
        return source.index(value, start, stop)
    except ValueError:
        return None
