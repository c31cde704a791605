"""The rows of one step's logits and who samples from them, from the forward to the tokens on the host.

A step's forward gives one logits row per sequence that samples (`SchedulerOutput.sampling()`). Before the
sampler runs, beam search rows leave for their batched candidate selection (`BeamSearches.select`), and each
prompt that completes in the step and asks for n > 1 samples gets its samples made now (`fork_rows`): each
draws its first token from a copy of its prompt's row, and is forked in the scheduler once the forward has
written the prompt's KV (`Scheduler.fork_samples`, at the next step). `launch` fills the grammar masks and
queues the sampling; `InFlight` is the launched step until its tokens are read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.sample.beam_search import PendingCandidates
from streamd.engine.sample.grammar import Grammars
from streamd.engine.sample.sampler import PendingSample, Sampler
from streamd.engine.sample.speculative import PendingVerify, verify
from streamd.engine.worker.host_to_device import to_device

Forks = list[tuple[ScheduledSeq, list[Sequence]]]  # a completing prompt's row and the samples made from it


@dataclass(slots=True)
class SampleRows:
    """A step whose forward is queued: its plan, the rows that sample (forked samples appended) and their
    logits (on CUDA still being computed while the host prepares the grammar masks)."""

    out: SchedulerOutput
    sampling: list[ScheduledSeq]
    logits: torch.Tensor
    forks: Forks
    beams: PendingCandidates | None  # beam search requests' candidates (their rows are not in `sampling`)
    drafted: DraftRows | None = None  # decodes with draft tokens (their rows are not in `sampling`)


@dataclass(slots=True)
class InFlight:
    """A launched step: its plan, the rows that sample, and their tokens on the way to the host."""

    out: SchedulerOutput
    sampling: list[ScheduledSeq]
    pending: PendingSample
    rows: dict[int, int]  # seq_id -> row of `pending.tokens`
    # Prompts that completed in this step and the samples made from them, forked once their KV is written.
    forks: Forks
    beams: PendingCandidates | None = None
    verified: PendingVerify | None = None  # decodes with draft tokens: their verification
    dispatch_s: float = 0.0  # host seconds spent queuing its forward and sampling (on the CPU: computing them)


@dataclass(slots=True)
class DraftRows:
    """The decodes of a step that carry draft tokens, and their logits rows (k + 1 each, item after item)."""

    items: list[ScheduledSeq]
    logits: torch.Tensor


def split_drafts(
    logits: torch.Tensor, sampling: list[ScheduledSeq]
) -> tuple[torch.Tensor, list[ScheduledSeq], DraftRows | None]:
    """Separates the rows of decodes with drafts (several each) from the others (one each)."""
    plain_rows: list[int] = []
    draft_rows: list[int] = []
    plain: list[ScheduledSeq] = []
    drafted: list[ScheduledSeq] = []
    row = 0
    for item in sampling:
        if item.draft is None:
            plain_rows.append(row)
            plain.append(item)
            row += 1
            continue
        count = len(item.draft.token_ids) + 1
        draft_rows.extend(range(row, row + count))
        drafted.append(item)
        row += count
    if not drafted:
        return logits, sampling, None
    dev = logits.device
    mine = logits.index_select(0, to_device(draft_rows, torch.int64, dev))
    others = logits.index_select(0, to_device(plain_rows, torch.int64, dev))
    return others, plain, DraftRows(drafted, mine)


def fork_rows(logits: torch.Tensor, sampling: list[ScheduledSeq]) -> tuple[torch.Tensor, list[ScheduledSeq], Forks]:
    """The samples of every completing prompt that asks for several, each with its prompt's logits row
    appended to the batch."""
    forks = [(item, _children(item.group)) for item in sampling if item.group.needs_fork]
    if not forks:
        return logits, sampling, forks
    row_of = {id(item): i for i, item in enumerate(sampling)}
    rows = list(range(len(sampling)))
    sampling = list(sampling)
    for item, children in forks:
        for child in children:
            rows.append(row_of[id(item)])
            sampling.append(ScheduledSeq(child, item.group, 0))
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    return logits.index_select(0, index), sampling, forks


def launch(step: SampleRows, sampler: Sampler, grammars: Grammars, constrained: list[int]) -> InFlight:
    """Fills the grammar masks of the `constrained` rows (their matchers are up to date) and queues the
    sampling."""
    sampling, logits = step.sampling, step.logits
    seqs = [item.seq for item in sampling]
    bitmask = grammars.bitmask(seqs, constrained, logits.device) if constrained else None
    pending = sampler.sample_async(
        logits, seqs, [item.group.sampling_params for item in sampling], bitmask, owns_logits=True
    )
    rows = {item.seq.seq_id: i for i, item in enumerate(sampling)}
    drafted = step.drafted
    verified = None
    if drafted is not None:
        verified = verify(sampler, drafted.logits, drafted.items, grammars.draft_bitmask(drafted.items, logits.device))
    return InFlight(step.out, sampling, pending, rows, step.forks, step.beams, verified)


def _children(group: SequenceGroup) -> list[Sequence]:
    """The samples to fork from a request's prompt (the prompt's own sequence is sample 0)."""
    prompt = group.prompt_token_ids
    return [Sequence(prompt_token_ids=prompt, sample_index=i) for i in range(len(group.seqs), group.width)]
