"""The scheduler applies what a step sampled (`update_from_output`, nano-vllm's `postprocess`): each token
appended or put in its placeholder's place, the StopChecker's reason turned into the sequence's finished
status (the checker itself writes nothing), a grammar's refusal turned into a dead end, and the samples of a
completed prompt forked, or dropped when the prompt's request ended first. One finish vocabulary maps
statuses and reasons both ways."""

from __future__ import annotations

import pytest

from streamd.config import SchedulerConfig
from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.scheduler import Scheduler
from streamd.engine.core.scheduler_output import ScheduledSeq
from streamd.engine.core.sequence import FINISHED, PLACEHOLDER, Sequence, SequenceGroup, SequenceStatus
from streamd.engine.sampling_params import SamplingParams

EOS = 0


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, "recompute"), BlockManager(32, 4, watermark=0.0), 64, eos_token_ids=[EOS])


def _running(sched: Scheduler, rid: str, **params) -> SequenceGroup:
    group = SequenceGroup(rid, [Sequence([5, 6, 7])], SamplingParams(detokenize=False, **params))
    sched.add_seq_group(group)
    out = sched.schedule()
    sched.on_step_done(out)
    return group


def test_tokens_stops_and_placeholders() -> None:
    sched = _scheduler()
    eos, short, going = _running(sched, "eos"), _running(sched, "short", max_tokens=1), _running(sched, "going")
    sampling = [_item(g) for g in (eos, short, going)]  # one decode row each
    going.seqs[0].append_token(PLACEHOLDER)  # its token was on its way to the host
    outcome = sched.update_from_output(sampling, [EOS, 9, 11], None)
    assert [s.status for g in (eos, short, going) for s in g.seqs] == [
        SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.RUNNING]
    assert going.seqs[0].output_token_ids == [11] and eos.seqs[0].output_token_ids == [EOS]
    assert [(u.request_id, u.seqs[0].token_ids, u.seqs[0].finish_reason) for u in outcome.updates.values()] == [
        ("eos", [EOS], "stop"), ("short", [9], "length"), ("going", [11], None)]
    assert outcome.ended == [eos, short] and outcome.num_tokens == 3
    assert sched.free_finished(outcome.ended) == [eos, short] and sched.num_running == 1
    again = sched.update_from_output(sampling, [3, 3, 12], None)  # the finished ones' tokens are void
    assert list(again.updates) == ["going"] and eos.seqs[0].output_token_ids == [EOS]


def test_a_grammar_refusal_is_a_dead_end() -> None:
    sched = _scheduler()
    group = _running(sched, "g")
    outcome = sched.update_from_output([_item(group)], [9], None, accept=lambda seq, token: False)
    seq = group.seqs[0]
    assert seq.status is SequenceStatus.FINISHED_ABORTED and seq.output_token_ids == []
    update = outcome.updates["g"]
    assert update.seqs[0].finish_reason == "abort" and "dead end" in (update.error or "")
    assert outcome.num_tokens == 0 and outcome.ended == [group]


def test_samples_are_forked_or_dropped() -> None:
    sched = _scheduler()
    live, ended = _running(sched, "live", n=2), _running(sched, "ended", n=2)
    children = {rid: [Sequence([5, 6, 7], sample_index=1)] for rid in ("live", "ended")}
    sched.abort_seq_group("ended")
    dropped = sched.fork_samples([(_item(live), children["live"]), (_item(ended), children["ended"])])
    assert dropped == children["ended"] and dropped[0].status is SequenceStatus.FINISHED_ABORTED
    child = children["live"][0]
    assert live.seqs == [live.seqs[0], child] and child.status is SequenceStatus.RUNNING
    assert child.num_computed_tokens == live.seqs[0].num_computed_tokens == 3
    assert child.block_table == live.seqs[0].block_table


@pytest.mark.parametrize("status", [s for s in SequenceStatus if s >= FINISHED])
def test_one_finish_vocabulary(status: SequenceStatus) -> None:
    assert status.finished and SequenceStatus.of_reason(status.finish_reason) is status
    assert SequenceStatus.of_reason("timeout") is SequenceStatus.FINISHED_ABORTED
    assert SequenceStatus.RUNNING.finish_reason is None and not SequenceStatus.SWAPPED.finished


def _item(group: SequenceGroup) -> ScheduledSeq:
    return ScheduledSeq(group.seqs[0], group, 1)
