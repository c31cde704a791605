"""`PendingDelta`, the one pending-delta helper of every sink (`RequestStream`, a WebSocket request): newer
deltas merge into the unsent one, its tokens are counted for `Backpressure` (which pauses past the limit and
resumes under half of it once taken), a final delta's tokens are not counted, and a dropped delta leaves a
paused request paused."""

from __future__ import annotations

from streamd.engine.client.request_stream import Backpressure, PendingDelta, RequestStream
from streamd.engine.outputs import CompletionDelta, RequestDelta


def _delta(text: str, tokens: list[int], finished: bool = False) -> RequestDelta:
    return RequestDelta("r", 3, [CompletionDelta(0, text, tokens, "length" if finished else None)], finished)


def test_merges_counts_and_takes() -> None:
    calls: list[tuple[str, bool]] = []
    pending = PendingDelta(Backpressure("r", 4, lambda rid, paused: calls.append((rid, paused))))
    pending.add(_delta("a", [1, 2]))
    pending.add(_delta("b", [3, 4, 5]))  # 5 unsent > 4: paused
    assert pending.unsent == 5 and calls == [("r", True)]
    pending.add(_delta("c", [6], finished=True))  # a final delta's tokens are not counted
    assert pending.unsent == 5
    taken = pending.take()
    assert taken is not None and taken.finished
    assert (taken.outputs[0].text, taken.outputs[0].token_ids) == ("abc", [1, 2, 3, 4, 5, 6])
    assert pending.unsent == 0 and pending.delta is None and calls == [("r", True), ("r", False)]
    assert pending.take() is None


def test_dropped_delta_leaves_the_request_paused() -> None:
    calls: list[tuple[str, bool]] = []
    pending = PendingDelta(Backpressure("r", 1, lambda rid, paused: calls.append((rid, paused))))
    pending.add(_delta("ab", [1, 2]))
    dropped = pending.drop()
    assert dropped is not None and dropped.outputs[0].token_ids == [1, 2]
    assert pending.delta is None and calls == [("r", True)]


async def test_a_request_stream_merges_through_its_pending_delta() -> None:
    aborted: list[str] = []
    stream = RequestStream("r", aborted.append)
    stream.put(_delta("a", [1]))
    stream.put(_delta("b", [2], finished=True))
    stream.put(_delta("late", [3]))  # after the final delta: ignored
    assert [(d.outputs[0].text, d.finished) async for d in stream] == [("ab", True)]
    stream.cancel()
    assert aborted == []  # already finished: nothing to abort
