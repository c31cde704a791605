"""Per-request progress before the first token: where a request waits in the queue, and how much of its
prompt the model has read.

A long prefill (or a long queue) gives a client nothing for seconds; a chat UI then looks frozen and its user
reloads, wasting the compute. The engine therefore reports, as `RequestUpdate`s without tokens carrying a
`Progress`: a waiting request's place in the queue (on its first step in the queue, then whenever it
changes, checked every `QUEUE_INTERVAL_S`, and again after `HEARTBEAT_S` unchanged, so a client hears from
its request at least every second; not for a request whose `queue_reports` is off: its route sends nothing of
it), and a prompt chunk that completed without finishing the prompt
(the chunk that finishes it samples the first token, which says more). The server decides what to send and
how often (`/v1/stream`'s `progress` frame, the Responses API's `response.queued`). Plain Python, read-only
over the scheduler's queues: it writes no scheduling state.
"""

from __future__ import annotations

import time
from collections import deque

from streamd.engine.core.scheduler_output import SchedulerOutput
from streamd.engine.core.sequence import SequenceGroup, SequenceStatus
from streamd.engine.outputs import Progress, RequestUpdate

QUEUE_INTERVAL_S = 0.25  # queue places that changed are reported at most this often (a new arrival at once)
HEARTBEAT_S = 1.0  # a waiting request's place is reported again after this long even if unchanged


class ProgressReports:
    """Decides which progress updates a step hands out; remembers each waiting request's last reported place."""

    def __init__(self) -> None:
        self._places: dict[str, tuple[int, float]] = {}  # request id -> (the place last reported, when)
        self._next_queue_report = 0.0

    def step(self, done: SchedulerOutput | None, waiting: deque[SequenceGroup]) -> list[RequestUpdate]:
        """The updates of a step: `done` is the step whose forward just completed (its chunks are computed)."""
        updates = self._chunks(done) if done is not None and done.num_prefill_tokens else []
        if not waiting:  # (most steps under load: nothing to walk or time)
            self._places.clear()
            return updates
        return updates + self._queue(waiting)

    def _chunks(self, done: SchedulerOutput) -> list[RequestUpdate]:
        """Prompt chunks that completed without finishing their prompt (the first sequence of a group; its
        `num_computed_tokens` already counts the chunk). Only the prompt chunks are walked, never the decodes
        (the last `num_decode_tokens` items)."""
        updates = []
        for item in done.scheduled[: len(done.scheduled) - done.num_decode_tokens]:
            seq, group = item.seq, item.group
            if seq.status is not SequenceStatus.RUNNING or seq.prompt_computed or seq is not group.seqs[0]:
                continue
            self._places.pop(group.request_id, None)
            progress = Progress(None, seq.num_computed_tokens, group.num_cached_tokens)
            updates.append(_update(group, progress))
        return updates

    def _queue(self, waiting: deque[SequenceGroup]) -> list[RequestUpdate]:
        """Every QUEUE_INTERVAL_S, the waiting requests whose place changed or was last told HEARTBEAT_S ago;
        between, only new arrivals (the queue's unreported tail), so a step never walks a long queue."""
        now = time.monotonic()
        if now < self._next_queue_report:
            return self._arrivals(waiting, now)
        self._next_queue_report = now + QUEUE_INTERVAL_S
        updates, places = [], {}
        for place, group in enumerate(waiting, start=1):
            last = self._places.get(group.request_id)
            if last is None or last[0] != place or now - last[1] >= HEARTBEAT_S:
                if group.sampling_params.queue_reports:
                    updates.append(_update(group, Progress(place, 0, 0)))
                last = (place, now)
            places[group.request_id] = last
        self._places = places
        return updates

    def _arrivals(self, waiting: deque[SequenceGroup], now: float) -> list[RequestUpdate]:
        updates = []
        for offset, group in enumerate(reversed(waiting)):
            if group.request_id in self._places:
                break
            place = len(waiting) - offset
            self._places[group.request_id] = (place, now)
            if group.sampling_params.queue_reports:
                updates.append(_update(group, Progress(place, 0, 0)))
        return updates[::-1]


def _update(group: SequenceGroup, progress: Progress) -> RequestUpdate:
    return RequestUpdate(group.request_id, [], group.num_cached_tokens, group.first_scheduled_time, progress=progress)
