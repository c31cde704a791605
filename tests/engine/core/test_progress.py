"""ProgressReports (engine/core/progress.py) without an engine: which queue places and prompt chunks a step
reports, on a clock the test moves (the server-side frames: tests/server/ws/test_progress.py)."""

from __future__ import annotations

from collections import deque

import pytest

from streamd.engine.core import progress
from streamd.engine.core.progress import HEARTBEAT_S, QUEUE_INTERVAL_S, ProgressReports
from streamd.engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from streamd.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from streamd.engine.outputs import Progress, RequestUpdate
from streamd.engine.sampling_params import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    return clock


def group(name: str, prompt_len: int = 40) -> SequenceGroup:
    return SequenceGroup(name, [Sequence(list(range(prompt_len)))], SamplingParams())


def places(updates: list[RequestUpdate]) -> list[tuple[str, int | None]]:
    return [(u.request_id, u.progress.queue_position if u.progress else None) for u in updates]


def test_queue_places_arrivals_at_once_changes_per_interval_and_a_heartbeat(clock: Clock) -> None:
    reports, waiting = ProgressReports(), deque([group("a"), group("b")])
    assert places(reports.step(None, waiting)) == [("a", 1), ("b", 2)]
    assert reports.step(None, waiting) == []  # nothing new
    waiting.append(group("c"))
    assert places(reports.step(None, waiting)) == [("c", 3)]  # a new arrival is told at once
    waiting.popleft()
    clock.now += QUEUE_INTERVAL_S / 2
    assert reports.step(None, waiting) == []  # places changed: told at the next interval only
    clock.now += QUEUE_INTERVAL_S
    assert places(reports.step(None, waiting)) == [("b", 1), ("c", 2)]
    clock.now += QUEUE_INTERVAL_S
    assert reports.step(None, waiting) == []
    clock.now += HEARTBEAT_S
    assert places(reports.step(None, waiting)) == [("b", 1), ("c", 2)]  # unchanged, told again


def test_an_empty_queue_forgets_places_so_a_request_back_in_it_is_told_at_once(clock: Clock) -> None:
    reports, a = ProgressReports(), group("a")
    assert places(reports.step(None, deque([a]))) == [("a", 1)]
    assert reports.step(None, deque()) == []
    assert places(reports.step(None, deque([a]))) == [("a", 1)]  # (preempted back into the queue)


def test_only_a_chunk_that_leaves_its_prompt_unfinished_is_reported(clock: Clock) -> None:
    partial, finished, decoding = group("p"), group("f"), group("d")
    for g, computed in ((partial, 16), (finished, 40), (decoding, 41)):
        seq = g.seqs[0]
        seq.status, seq.num_computed_tokens = SequenceStatus.RUNNING, computed  # after the step's forward
    decoding.seqs[0].append_token(7)
    partial.num_cached_tokens = 8
    done = SchedulerOutput(
        scheduled=[ScheduledSeq(partial.seqs[0], partial, 8), ScheduledSeq(finished.seqs[0], finished, 24),
                   ScheduledSeq(decoding.seqs[0], decoding, 1)],
        num_prefill_tokens=32,
        num_decode_tokens=1,
    )
    updates = ProgressReports().step(done, deque())
    assert updates == [RequestUpdate("p", [], 8, None, progress=Progress(None, 16, 8))]
    done.num_prefill_tokens = 0  # a step without prompt chunks walks nothing
    assert ProgressReports().step(done, deque()) == []


def test_a_request_without_queue_reports_is_never_told_its_place_but_keeps_its_chunks(clock: Clock) -> None:
    """`queue_reports` off (chat and completions send nothing of it): no place on arrival, on a change or a
    heartbeat, while the others around it are told theirs as before."""
    quiet = group("q")
    quiet.sampling_params.queue_reports = False
    reports, waiting = ProgressReports(), deque([group("a"), quiet, group("b")])
    assert places(reports.step(None, waiting)) == [("a", 1), ("b", 3)]
    waiting.popleft()
    clock.now += QUEUE_INTERVAL_S
    assert places(reports.step(None, waiting)) == [("b", 2)]
    clock.now += HEARTBEAT_S
    assert places(reports.step(None, waiting)) == [("b", 2)]
