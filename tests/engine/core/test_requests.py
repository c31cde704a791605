"""RequestRegistry: one record per live request, torn down in one call (counts, hooks, deadlines)."""

from __future__ import annotations

import time

import pytest

from streamd.engine.core.requests import Request, RequestRegistry
from streamd.engine.core.sequence import Sequence, SequenceGroup
from streamd.engine.errors import RequestError
from streamd.engine.sampling_params import SamplingParams


def _group(rid: str, **params) -> SequenceGroup:
    return SequenceGroup(rid, [Sequence([1, 2, 3])], SamplingParams(**params), arrival_time=time.monotonic())


def test_remove_tears_down_everything_in_one_call() -> None:
    registry: RequestRegistry[str] = RequestRegistry()
    torn: list[str] = []
    registry.on_remove(lambda request: torn.append(request.request_id))
    beam = _group("b", use_beam_search=True, beam_width=2, temperature=0.0, timeout_s=60.0)
    plain = _group("p", queue_timeout_s=30.0)
    registry.add(beam, "search state")
    registry.add(plain)
    assert (len(registry), registry.num_serial, registry.num_beam) == (2, 1, 1)
    assert registry.get("b").beam == "search state" and "p" in registry
    assert registry.next_deadline == pytest.approx(plain.arrival_time + 30.0)

    removed = registry.remove("p")
    assert isinstance(removed, Request) and removed.group is plain and torn == ["p"]
    assert registry.get("p") is None and "p" not in registry
    # Its deadline no longer applies: the beam request's is the next one.
    assert registry.next_deadline == pytest.approx(beam.arrival_time + 60.0)

    registry.remove("b")
    assert (len(registry), registry.num_serial, registry.num_beam) == (0, 0, 0)
    assert registry.next_deadline is None and torn == ["p", "b"]
    assert registry.remove("b") is None and torn == ["p", "b"]  # idempotent: the hooks run once


def test_expired_gives_each_live_request_once() -> None:
    registry: RequestRegistry[None] = RequestRegistry()
    past = time.monotonic() - 10
    due = SequenceGroup("due", [Sequence([1])], SamplingParams(timeout_s=1.0, queue_timeout_s=0.5), arrival_time=past)
    gone = SequenceGroup("gone", [Sequence([1])], SamplingParams(timeout_s=1.0), arrival_time=past)
    later = _group("later", timeout_s=600.0)
    scheduled = SequenceGroup("scheduled", [Sequence([1])], SamplingParams(queue_timeout_s=1.0), arrival_time=past)
    scheduled.first_scheduled_time = past + 0.1  # a queue deadline ends at first scheduling
    for group in (due, gone, later, scheduled):
        registry.add(group)
    registry.remove("gone")
    assert [r.request_id for r in registry.expired()] == ["due"]
    assert registry.expired() == []
    assert registry.next_deadline == pytest.approx(later.arrival_time + 600.0)


def test_a_request_id_is_registered_once() -> None:
    registry: RequestRegistry[None] = RequestRegistry()
    registry.add(_group("r"))
    with pytest.raises(RequestError, match="'r' is already in flight"):
        registry.check_new("r")
    with pytest.raises(RequestError, match="'r' is already in flight"):
        registry.add(_group("r"))
    registry.remove("r")
    registry.check_new("r")
