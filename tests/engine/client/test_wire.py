"""The wire codec: every record a step batch carries crosses field by field (each field set to a value that
is not its default, so a field the codec did not know would arrive wrong), a field added to a record
crosses without the codec being told, loop-local fields stay home, unpicklable errors arrive as their
message, and the framing splits a byte stream back into messages."""

from __future__ import annotations

import asyncio
import dataclasses
import pickle
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import pytest

from streamd.engine.client import wire
from streamd.engine.client.loop import STEP_BATCH_WIRE, CallResult, Rejection, StepBatch
from streamd.engine.client.wire import Codec
from streamd.engine.outputs import CompletionDelta, Progress, RequestDelta, RequestUpdate, SeqUpdate
from streamd.engine.stats import EngineStats, KVCacheStats, SchedulerStats, TenantStats, TierStats


def _value(tp: Any, seed: int) -> Any:
    """A value of type `tp` that is no field's default."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _sample(tp, seed)
    if origin in (typing.Union, types.UnionType):
        return _value(next(a for a in args if a is not type(None)), seed)
    if origin is typing.Literal:
        return args[-1]
    if origin is list:
        return [_value(args[0], seed + 1), _value(args[0], seed + 2)]
    if origin is dict:
        return {_value(args[0], seed): _value(args[1], seed)}
    if isinstance(tp, type) and issubclass(tp, BaseException):
        return ValueError(f"error {seed}")
    return {bool: True, int: 7 + seed, float: 0.5 + seed, str: f"s{seed}"}[tp]


def _sample(cls: type, seed: int = 0) -> Any:
    """An instance whose every wire field is set (loop-local fields keep their defaults)."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("wire", True)]
    return cls(**{f.name: _value(hints[f.name], seed + i) for i, f in enumerate(fields)})


def _plain(value: Any) -> Any:
    """Comparable form: records by field, errors by type and message."""
    if dataclasses.is_dataclass(value):
        return type(value).__name__, {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, BaseException):
        return type(value).__name__, str(value)
    return value


def _cross(codec: Codec[Any], record: Any) -> Any:
    return codec.decode(pickle.loads(pickle.dumps(codec.encode(record), pickle.HIGHEST_PROTOCOL)))


def test_the_step_batch_codec_reaches_every_record() -> None:
    assert STEP_BATCH_WIRE.records == {StepBatch, Rejection, RequestDelta, CompletionDelta, RequestUpdate, SeqUpdate,
                                       EngineStats, KVCacheStats, SchedulerStats, TenantStats, TierStats, Progress}


@pytest.mark.parametrize("record", sorted(STEP_BATCH_WIRE.records, key=lambda c: c.__name__),
                         ids=lambda c: c.__name__)
def test_every_record_round_trips_field_by_field(record: type) -> None:
    sample = _sample(record)
    for f in dataclasses.fields(record):  # every wire field differs from its default, so a dropped one shows
        if f.metadata.get("wire", True) and f.default is not dataclasses.MISSING:
            assert getattr(sample, f.name) != f.default, f.name
    assert _plain(_cross(Codec(record), sample)) == _plain(sample)


def test_a_full_step_batch_round_trips() -> None:
    batch = _sample(StepBatch)
    assert _plain(_cross(STEP_BATCH_WIRE, batch)) == _plain(batch)
    assert len(batch.deltas) == 2 and len(batch.deltas[0].outputs) == 2  # nested records were sampled


@dataclass(slots=True)
class _Grown(SeqUpdate):
    """SeqUpdate with one more field, as if someone added it."""

    note: str = ""


@dataclass(slots=True)
class _Holder:
    items: list[_Grown]
    one: _Grown | None = None


def test_a_field_added_to_a_record_crosses_without_telling_the_codec() -> None:
    holder = _Holder([_Grown(1, [2, 3], note="new")], _Grown(4, [5], note="also"))
    assert _cross(Codec(_Holder), holder) == holder


def test_loop_local_fields_stay_home() -> None:
    loop = asyncio.new_event_loop()
    try:
        batch = StepBatch(accepted=["a"], calls=[CallResult(loop.create_future(), 1)])
        assert _cross(STEP_BATCH_WIRE, batch) == StepBatch(accepted=["a"])
    finally:
        loop.close()


class _Unpicklable(Exception):
    def __init__(self, message: str, handle: Any) -> None:
        super().__init__(message)
        self.handle = handle

    def __reduce__(self) -> Any:
        raise TypeError("not picklable")


def test_an_error_that_cannot_be_pickled_arrives_as_its_message() -> None:
    batch = StepBatch(rejected=[Rejection("a", _Unpicklable("bad prompt", object())), Rejection("b", ValueError("v"))])
    got = _cross(STEP_BATCH_WIRE, batch)
    assert [(type(r.error), str(r.error)) for r in got.rejected] == [(RuntimeError, "bad prompt"), (ValueError, "v")]


@dataclass(slots=True)
class _Mapped:
    by_id: dict[str, SeqUpdate] = field(default_factory=dict)


def test_records_the_codec_cannot_reach_are_refused_when_it_is_built() -> None:
    with pytest.raises(TypeError, match="cannot cross the wire"):
        Codec(_Mapped)


def test_frames_split_back_into_messages_across_reads() -> None:
    messages = [STEP_BATCH_WIRE.encode(StepBatch(accepted=[f"r{i}"])) for i in range(3)]
    data = b"".join(wire.frame(m) for m in messages)
    reader, got = wire.FrameReader(), []
    for start in range(0, len(data), 7):  # reads that cut headers and payloads anywhere
        got += reader.feed(data[start:start + 7])
    assert got == messages and not reader.buffer
