"""Sequence and SequenceGroup: the engine's scheduling record of one generation and of one request.

Scheduling state only: what the block manager, scheduler and model runner need. Text, stop strings, logprobs
and everything else a user sees of the output live in the output processor. A `Sequence` holds its token ids
(changed only through its own methods), how many of them have KV in the cache (`num_computed_tokens`, written
only by the Scheduler), its status (written only by the Scheduler) and its block table (list of physical block
ids, written only by the BlockManager). A `SequenceGroup` is one request: its sequences (parallel samples or beams,
sharing blocks through fork) are scheduled, preempted and resumed together. Plain Python, no torch, so the
block manager and scheduler that use these records stay testable in milliseconds.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from streamd.engine.outputs import FinishReason
from streamd.engine.sampling_params import SamplingParams


class SequenceStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        """The finish reason a user sees for this status (None while unfinished)."""
        return _REASONS.get(self)

    @staticmethod
    def of_reason(reason: FinishReason) -> SequenceStatus:
        """The finished status a finish reason gives a sequence (a timeout aborts it)."""
        return _STATUSES[reason]


FINISHED = SequenceStatus.FINISHED_STOPPED  # the statuses from this one on are finished
# The one map between the engine's finished statuses and the finish reasons (`outputs.FinishReason`).
_REASONS: dict[SequenceStatus, FinishReason] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
}
_STATUSES: dict[FinishReason, SequenceStatus] = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
    "timeout": SequenceStatus.FINISHED_ABORTED,
}


_seq_ids = itertools.count()

# Stands in `Sequence.token_ids` for a token the device has sampled but the host has not received yet
# (the engine overlaps the next step with that transfer). Never fed to a model or a tokenizer as is.
PLACEHOLDER = -1


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens. `token_ids` is prompt + output; KV exists for the first
    `num_computed_tokens` of them."""

    prompt_token_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # The sliding-window layers' page table in the hybrid layout (`hybrid_blocks.py`; empty without it)
    window_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # This sample's index within its request (CompletionOutput.index). Seeded sampling mixes it into the
    # seed so the n samples of one seeded request differ; the engine sets it when it creates/forks seqs.
    sample_index: int = 0
    prefix_root: int = 0  # the parent hash of its first block (`prefix_cache.prefix_root`; 0: shared cache)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_computed(self) -> bool:
        """Its whole prompt has KV: it has sampled, or is decoding."""
        return self.num_computed_tokens >= self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def receive_token(self, token_id: int) -> None:
        """A sampled token reaching the host: it takes the place of the placeholder that stood for it, if
        one does, else it is appended."""
        token_ids = self.token_ids
        if token_ids[-1] == PLACEHOLDER:
            token_ids[-1] = token_id
        else:
            token_ids.append(token_id)

    def drop_placeholder(self) -> None:
        """Drops a trailing placeholder (its token will never reach the host)."""
        if self.token_ids and self.token_ids[-1] == PLACEHOLDER:
            self.token_ids.pop()

    def drop_last_token(self) -> None:
        self.token_ids.pop()

    def fork(self, child: Sequence | None = None) -> Sequence:
        """A child (`child`, made to continue this sequence, or a new one) with this sequence's tokens. The
        Scheduler gives it its status and computed count, the BlockManager its (shared) blocks."""
        if child is None:
            child = Sequence(prompt_token_ids=self.prompt_token_ids)
        child.token_ids = list(self.token_ids)
        child.prefix_root = self.prefix_root
        return child


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request. Its sequences live and move together through the scheduler's queues."""

    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # monotonic; set by the scheduler when it first admits it
    num_cached_tokens: int = 0
    # The request's `prediction` (the output it expects), tokenized: drafts for speculative decoding.
    prediction_token_ids: list[int] = field(default_factory=list)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    @property
    def width(self) -> int:
        """How many sequences the request runs at once once its prompt is done (parallel samples, or
        the beams of a beam search)."""
        params = self.sampling_params
        return params.beam_width if params.beam_width is not None else params.n

    @property
    def needs_fork(self) -> bool:
        """The prompt's one sequence is still to be forked into the request's samples (beams are forked
        by the beam search step instead)."""
        return len(self.seqs) < self.sampling_params.n and not self.sampling_params.use_beam_search

    def prefill_end(self, seq: Sequence) -> int:
        """Up to which token a prefill of `seq` may compute: all its tokens, except that a beam recomputed
        after a preemption stops before its last token and then decodes it with its sibling beams (a beam
        search step needs the logits of all the group's beams in one step)."""
        if self.sampling_params.use_beam_search and seq.num_output_tokens:
            return seq.num_tokens - 1
        return seq.num_tokens

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status == status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)
