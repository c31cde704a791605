"""Beam search: one request's search state, the step's batched candidate selection, and the final beams.

Semantics of Hugging Face `generate(num_beams=K, do_sample=False)` (transformers 5.x `_beam_search`):

- A beam's score is the sum of its tokens' log-softmax values (float32, as HF). Each step, every running
  beam of every beam request in the batch is expanded in ONE device operation: log_softmax of its logits
  row plus the beam's score, the request's beams laid side by side ([requests, K * vocab]) and the top
  `(1 + number of stop tokens, at least 2) * K` candidates taken (`select_candidates`); their values and
  indices reach the host in one transfer per step, never one per beam.
- On the host (`BeamSearch.step`), in score order: a candidate ending in a stop token (EOS,
  `stop_token_ids`), or reaching `max_tokens` / the context, is a finished hypothesis, kept only if it
  ranks among the first K candidates; its final score is the sum divided by
  `generated_length ** length_penalty` (the prompt is not counted; the stop token is). At most K
  hypotheses are kept, best first. The first K candidates that did not finish are the next beams.
- The search ends when K hypotheses are finished and `early_stopping` is True; or when the best running
  beam cannot beat the worst of K finished hypotheses (its score over the current length ** penalty for
  False, over the longest possible length for "never" with a positive penalty); or at the length limit.
  The best `n` hypotheses are the request's choices.

Beams are sequences of the request's group: a parent picked by several next beams is forked and a beam no
next beam continues is freed (`Scheduler.replace_beams`). Text is made only from the final beams (beams
swap parents every step, so nothing is streamed before the end).

`BeamSearches` is the engine's beam search lifecycle, one hook per moment: `create` (admission: the state
hung on the request's registry record, and gone with it), `select` (the step's beam rows leave the
sampling batch for the batched selection) and `advance` (the candidates read back move every search on).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from streamd.engine.core.requests import RequestRegistry
from streamd.engine.core.scheduler_output import ScheduledSeq, StepOutcome
from streamd.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from streamd.engine.outputs import FinishReason, RequestUpdate, SeqUpdate
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.worker.host_to_device import to_device

if TYPE_CHECKING:
    from streamd.engine.core.scheduler import Scheduler
    from streamd.engine.sample.grammar import Grammars, TokenBitmask


@dataclass(slots=True)
class Candidate:
    """A beam extended by one token: its cumulative log-probability, its parent's place among the
    group's beams, and the token."""

    score: float
    beam: int
    token_id: int


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its output tokens and its length-penalized score."""

    token_ids: list[int]
    score: float
    finish_reason: FinishReason
    stop_token_id: int | None  # the stop token (EOS excluded) that ended it


@dataclass(slots=True)
class BeamStep:
    """What one step decided for a request: the next beams (best first) or the end of the search."""

    beams: list[Candidate]
    done: bool


@dataclass(slots=True)
class BeamRows:
    """One request's rows in a step's logits (in the order of its beams) and what their expansion needs."""

    request_id: str
    rows: list[int]
    scores: list[float]
    num_candidates: int
    masked_token_ids: list[int]  # stop tokens not allowed yet (min_tokens)


@dataclass(slots=True)
class BeamSearch:
    """One beam search request's state. `scores` follows the group's beams (`SequenceGroup.seqs`)."""

    width: int
    num_choices: int
    length_penalty: float
    early_stopping: bool | str
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop_token_ids
    min_tokens: int
    max_new_tokens: int  # max_tokens, or what the context leaves
    scores: list[float] = field(default_factory=lambda: [0.0])
    finished: list[BeamHypothesis] = field(default_factory=list)

    @classmethod
    def create(cls, params: SamplingParams, eos_token_ids: set[int], max_new_tokens: int) -> BeamSearch:
        assert params.beam_width is not None
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        return cls(
            params.beam_width,
            params.n,
            float(params.length_penalty),
            params.early_stopping,
            eos,
            eos | frozenset(params.stop_token_ids),
            params.min_tokens,
            max_new_tokens,
        )

    @property
    def num_candidates(self) -> int:
        """As HF: enough candidates that K remain unfinished even if every beam's stop tokens rank first."""
        return max(2, 1 + len(self.stop_token_ids)) * self.width

    def rows(self, request_id: str, rows: list[int], num_output_tokens: int) -> BeamRows:
        masked = sorted(self.stop_token_ids) if num_output_tokens < self.min_tokens else []
        return BeamRows(request_id, rows, self.scores, self.num_candidates, masked)

    def step(self, candidates: list[Candidate], beams: list[Sequence]) -> BeamStep:
        """Takes the step's candidates (best first) for `beams`: records finished hypotheses, picks the
        next beams (and their scores), and says whether the search is over."""
        length = beams[0].num_output_tokens + 1  # every beam has the same length
        at_limit = length >= self.max_new_tokens
        running: list[Candidate] = []
        for rank, candidate in enumerate(candidates):
            if at_limit or candidate.token_id in self.stop_token_ids:
                if rank < self.width:
                    self._add(beams[candidate.beam].output_token_ids + [candidate.token_id], candidate, length)
            elif len(running) < self.width:
                running.append(candidate)
        self.scores = [c.score for c in running]
        done = at_limit or not running or self._finished_search(running[0].score, length)
        if done and len(self.finished) < self.num_choices:  # only when fewer candidates than beams exist
            for candidate in running[: self.num_choices - len(self.finished)]:
                self._add(beams[candidate.beam].output_token_ids + [candidate.token_id], candidate, length)
        return BeamStep(running, done)

    def _add(self, token_ids: list[int], candidate: Candidate, length: int) -> None:
        last = token_ids[-1]
        stopped = last in self.stop_token_ids
        self.finished.append(
            BeamHypothesis(
                token_ids,
                _penalized(candidate.score, length, self.length_penalty),
                "stop" if stopped else "length",
                last if stopped and last not in self.eos_token_ids else None,
            )
        )
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.width :]

    def _finished_search(self, best_running: float, length: int) -> bool:
        """HF's stopping rule, once K hypotheses are finished: early_stopping True stops at once; else stop
        when the best running beam's best possible score does not beat the worst finished one."""
        if len(self.finished) < self.width:
            return False
        if self.early_stopping is True:
            return True
        best_length = self.max_new_tokens if self.early_stopping == "never" and self.length_penalty > 0 else length
        return _penalized(best_running, best_length, self.length_penalty) <= self.finished[-1].score

    def final_updates(self) -> list[SeqUpdate]:
        """The best `n` hypotheses as the request's choices, each in one piece; a stop token comes in an
        update of its own, as in streaming, so the output processor drops its text the usual way."""
        updates = []
        for index, hyp in enumerate(self.finished[: self.num_choices]):
            if hyp.finish_reason == "stop":
                if len(hyp.token_ids) > 1:
                    updates.append(SeqUpdate(index, hyp.token_ids[:-1]))
                updates.append(SeqUpdate(index, hyp.token_ids[-1:], None, "stop", hyp.stop_token_id))
            else:
                updates.append(SeqUpdate(index, hyp.token_ids, None, hyp.finish_reason))
        return updates


def _penalized(score: float, length: int, length_penalty: float) -> float:
    """score / length ** length_penalty in float32, as HF computes it on its float32 score tensors."""
    return float(np.float32(score) / np.float32(length**length_penalty))


# ---- the batched device operation ---------------------------------------------------------------


def select_candidates(
    logits: torch.Tensor, groups: list[BeamRows], vocab_size: int, bitmask: TokenBitmask | None = None
) -> PendingCandidates:
    """Every group's top candidates from the step's logits in one batched operation (log_softmax, + the
    beams' scores, top-k over each group's beams side by side); the copy to the host starts now.
    `bitmask` (rows: the groups' rows stacked in order) gates constrained beams: as HF applies its logits
    processors, disallowed tokens get -inf after the log-softmax."""
    dev = logits.device
    rows = [row for g in groups for row in g.rows]
    width = max(len(g.rows) for g in groups)
    index = to_device(rows, torch.int64, dev)
    logprobs = torch.log_softmax(logits.index_select(0, index)[:, :vocab_size].float(), dim=-1)
    if bitmask is not None:
        bitmask.apply(logprobs)
    if any(g.masked_token_ids for g in groups):  # min_tokens: stop tokens get -inf, as HF's processor does
        mask_rows, mask_cols, first = [], [], 0
        for g in groups:
            tokens = [t for t in g.masked_token_ids if t < vocab_size]
            for row in range(first, first + len(g.rows)):
                mask_rows += [row] * len(tokens)
                mask_cols += tokens
            first += len(g.rows)
        at = to_device(mask_rows, torch.int64, dev), to_device(mask_cols, torch.int64, dev)
        logprobs.index_put_(at, torch.full((1,), float("-inf"), device=dev))
    logprobs += to_device([s for g in groups for s in g.scores], torch.float32, dev).unsqueeze(1)
    if any(len(g.rows) != width for g in groups):  # pad every group to `width` beams of -inf
        slots = [j * width + i for j, g in enumerate(groups) for i in range(len(g.rows))]
        padded = logprobs.new_full((len(groups) * width, vocab_size), float("-inf"))
        logprobs = padded.index_copy_(0, to_device(slots, torch.int64, dev), logprobs)
    k = min(max(g.num_candidates for g in groups), width * vocab_size)
    top = logprobs.view(len(groups), width * vocab_size).topk(k, dim=-1)
    # One transfer: scores and flat indices (exact in float64) side by side.
    return PendingCandidates(torch.cat([top.values.double(), top.indices.double()], dim=1), groups, vocab_size)


@dataclass(slots=True)
class PendingCandidates:
    """A step's beam candidates, on the device now and on the host once `result()` returns."""

    payload: torch.Tensor  # float64 [groups, 2k]: k scores then k flat indices (beam * vocab + token)
    groups: list[BeamRows]
    vocab_size: int
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        if self.payload.is_cuda:
            self.host = torch.empty(self.payload.shape, dtype=self.payload.dtype, pin_memory=True)
            self.host.copy_(self.payload, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> list[tuple[str, list[Candidate]]]:
        """(request id, its candidates best first) per group; candidates of -inf score (masked or
        padding) are left out."""
        if self.event is not None:
            self.event.synchronize()
        table = (self.host if self.host is not None else self.payload).tolist()
        k, vocab = self.payload.shape[1] // 2, self.vocab_size
        out = []
        for group, row in zip(self.groups, table):
            candidates = [
                Candidate(score, int(flat) // vocab, int(flat) % vocab)
                for score, flat in zip(row[: group.num_candidates], row[k : k + group.num_candidates])
                if score > float("-inf")
            ]  # (NaN also: a row with no allowed token)
            out.append((group.request_id, candidates))
        return out


# ---- the engine's lifecycle ---------------------------------------------------------------------


class BeamSearches:
    """The engine's beam search hooks (see the module docstring); the states live on the request records."""

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int, vocab_size: int) -> None:
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def create(self, params: SamplingParams, num_prompt_tokens: int) -> BeamSearch | None:
        """A beam search request's search state (None for any other request)."""
        if not params.use_beam_search:
            return None
        room = self.max_model_len - num_prompt_tokens
        return BeamSearch.create(params, self.eos_token_ids, min(params.max_tokens or room, room))

    def select(
        self,
        logits: torch.Tensor,
        sampling: list[ScheduledSeq],
        requests: RequestRegistry[BeamSearch],
        grammars: Grammars,
    ) -> tuple[torch.Tensor, list[ScheduledSeq], PendingCandidates | None]:
        """Splits the beam search rows off the sampling rows and starts their candidate selection (one
        device operation for all beam requests); returns the other rows' logits and items."""
        rows: dict[str, list[int]] = {}
        keep: list[int] = []
        for i, item in enumerate(sampling):
            if item.group.sampling_params.use_beam_search:
                rows.setdefault(item.group.request_id, []).append(i)
            else:
                keep.append(i)
        if not rows:
            return logits, sampling, None
        groups = [self._rows(requests, request_id, group_rows, sampling) for request_id, group_rows in rows.items()]
        # Constrained beams: their rows in the order select_candidates stacks them.
        seqs = [sampling[i].seq for g in groups for i in g.rows]
        bitmask = grammars.bitmask(seqs, grammars.constrained_rows(seqs), logits.device, own_buffer=True)
        beams = select_candidates(logits, groups, self.vocab_size, bitmask)
        index = torch.tensor(keep, dtype=torch.int64).to(logits.device, non_blocking=True)
        return logits.index_select(0, index), [sampling[i] for i in keep], beams

    @staticmethod
    def _rows(
        requests: RequestRegistry[BeamSearch], request_id: str, rows: list[int], sampling: list[ScheduledSeq]
    ) -> BeamRows:
        """One request's rows, in the order of its beams."""
        request = requests.get(request_id)
        assert request is not None and request.beam is not None, "a beam row of a request that is gone"
        group = request.group
        place = {id(seq): j for j, seq in enumerate(group.seqs)}
        rows.sort(key=lambda i: place[id(sampling[i].seq)])
        # The scheduler runs a beam group's beams together: one row per beam (its prompt at first).
        assert len(rows) == len(group.seqs), "a beam group sampled only some of its beams"
        return request.beam.rows(request_id, rows, group.seqs[0].num_output_tokens)

    def advance(
        self,
        pending: PendingCandidates,
        requests: RequestRegistry[BeamSearch],
        scheduler: Scheduler,
        grammars: Grammars,
        outcome: StepOutcome,
    ) -> None:
        """Every beam request's step from its candidates (requests aborted meanwhile are skipped); what
        ended and what is new goes into `outcome`."""
        for request_id, candidates in pending.result():
            request = requests.get(request_id)
            if request is not None and request.beam is not None:
                self._advance(request.group, request.beam, candidates, scheduler, grammars, outcome)

    @staticmethod
    def _advance(
        group: SequenceGroup,
        search: BeamSearch,
        candidates: list[Candidate],
        scheduler: Scheduler,
        grammars: Grammars,
        outcome: StepOutcome,
    ) -> None:
        """One beam search step of `group`: the next beams (forked from their parents, dropped beams freed
        at once) get their tokens; or the search is over and the best beams are the request's choices."""
        step = search.step(candidates, group.seqs)
        if step.done:
            scheduler.finish_group(group, SequenceStatus.FINISHED_STOPPED)
            outcome.ended.append(group)
            outcome.updates[group.request_id] = RequestUpdate(
                group.request_id, search.final_updates(), group.num_cached_tokens, group.first_scheduled_time
            )
            return
        parents = [group.seqs[c.beam] for c in step.beams]
        previous = list(group.seqs)
        beams = scheduler.replace_beams(group, parents)
        for beam, candidate in zip(beams, step.beams):
            beam.append_token(candidate.token_id)
        grammars.advance_beams(group, previous, parents, [c.token_id for c in step.beams])
        outcome.num_tokens += len(beams)  # the engine's work: every beam's token
