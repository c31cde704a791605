"""How records cross the process boundary: one codec derived from the dataclasses, and the framing.

A step's `StepBatch` (with its deltas or updates, rejections and stats) is the hot message of the served
path. Pickling slotted dataclasses costs a Python call per object (their `__getstate__`/`__setstate__`),
while a tuple of builtins is pickled in C; so each record travels as the tuple of its field values. The
tuple layout is never written by hand: `Codec(root)` reads `dataclasses.fields` and the type hints of the
root record once, follows every field typed as a record (`R`, `list[R]`, `R | None`), and compiles one
encoder and one decoder with every nested record inlined, as fast as a hand-ordered tuple. A field added to
a record travels from then on; a field that must not cross (a loop-local future) says so with
`metadata=LOCAL` and arrives as its default. Exceptions travel as themselves when they pickle, else as a
RuntimeError with their message.

Framing: each message is one length-prefixed pickle.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import struct
import types
import typing
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

LOCAL = {"wire": False}  # field metadata: this field stays in its process (decoded as its default)

HEADER = struct.Struct("<I")
READ_SIZE = 1 << 20


def portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(str(error))


class Codec(Generic[T]):
    """Record <-> nested tuples of builtins, compiled once from the record's fields (see the module doc)."""

    def __init__(self, root: type[T]) -> None:
        self.root = root
        self.records: set[type] = set()  # every record type reachable from `root`
        self._names: dict[str, Any] = {"_portable": portable}
        encode = self._encoder(root, "x", 0)
        decode = self._decoder(root, "x", 0)
        self.encode: Callable[[T], tuple[Any, ...]] = self._compile(f"lambda x: {encode}")
        self.decode: Callable[[tuple[Any, ...]], T] = self._compile(f"lambda x: {decode}")

    def _compile(self, source: str) -> Any:
        return eval(source, self._names)  # the source is built from field names and type hints only

    def _record(self, cls: type) -> tuple[list[dataclasses.Field[Any]], dict[str, Any]]:
        """The wire fields of a record (in order) and its resolved type hints."""
        if self._names.setdefault(cls.__name__, cls) is not cls:
            raise TypeError(f"two records named {cls.__name__} cross the wire")
        self.records.add(cls)
        wire = [f for f in dataclasses.fields(cls) if f.metadata.get("wire", True)]
        return wire, typing.get_type_hints(cls)

    # ---- encoding: an expression over `var` ------------------------------------------------------
    def _encoder(self, tp: Any, var: str, depth: int) -> str:
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            fields, hints = self._record(tp)
            parts = [self._field_encoder(hints[f.name], f"{var}.{f.name}", depth) for f in fields]
            return "(" + "".join(p + ", " for p in parts) + ")"
        return self._field_encoder(tp, var, depth)

    def _field_encoder(self, tp: Any, var: str, depth: int) -> str:
        if dataclasses.is_dataclass(tp):
            return self._encoder(tp, var, depth)
        inner = _optional(tp)
        if inner is not None and self._carries_records(inner):
            return f"(None if {var} is None else {self._field_encoder(inner, var, depth)})"
        item = _list_item(tp)
        if item is not None and self._carries_records(item):
            each = f"v{depth}"
            return f"[{self._field_encoder(item, each, depth + 1)} for {each} in {var}]"
        if isinstance(tp, type) and issubclass(tp, BaseException):
            return f"_portable({var})"
        self._check_plain(tp)
        return var

    # ---- decoding: an expression over `var` (a tuple made by the encoder) -------------------------
    def _decoder(self, tp: Any, var: str, depth: int) -> str:
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            parts = [f"{var}[{i}]" for i in range(len(self._record(tp)[0]))]
            built, plain = self._build(tp, parts, depth)
            return f"{tp.__name__}(*{var})" if plain else built  # plain: the arguments unpacked in C
        return self._field_decoder(tp, var, depth)

    def _build(self, cls: type, parts: list[str], depth: int) -> tuple[str, bool]:
        """The constructor call of `cls` from the expressions of its wire fields; plain when it takes them
        unchanged and in order (then `cls(*tuple)` does)."""
        fields, hints = self._record(cls)
        args = [self._field_decoder(hints[f.name], part, depth) for f, part in zip(fields, parts)]
        if [f for f in dataclasses.fields(cls) if f.init][: len(fields)] != fields:
            return f"{cls.__name__}({', '.join(f'{f.name}={a}' for f, a in zip(fields, args))})", False
        return f"{cls.__name__}({', '.join(args)})", args == parts

    def _field_decoder(self, tp: Any, var: str, depth: int) -> str:
        if dataclasses.is_dataclass(tp):
            return self._decoder(tp, var, depth)
        inner = _optional(tp)
        if inner is not None and self._carries_records(inner):
            return f"(None if {var} is None else {self._field_decoder(inner, var, depth)})"
        item = _list_item(tp)
        if item is not None and self._carries_records(item):
            return self._list_decoder(item, var, depth)
        return var

    def _list_decoder(self, item: Any, var: str, depth: int) -> str:
        """A list comprehension; a record item's tuple is unpacked in its `for` target (no indexing)."""
        each = f"v{depth}"
        if not (dataclasses.is_dataclass(item) and isinstance(item, type)):
            return f"[{self._field_decoder(item, each, depth + 1)} for {each} in {var}]"
        names = [f"{each}_{i}" for i in range(len(self._record(item)[0]))]
        built, plain = self._build(item, names, depth + 1)
        if plain:
            return f"[{item.__name__}(*{each}) for {each} in {var}]"
        return f"[{built} for ({', '.join(names)},) in {var}]"

    # ---- which types carry records ----------------------------------------------------------------
    def _carries_records(self, tp: Any) -> bool:
        if dataclasses.is_dataclass(tp) or (isinstance(tp, type) and issubclass(tp, BaseException)):
            return True
        inner = _optional(tp)
        item = _list_item(tp)
        return (inner is not None and self._carries_records(inner)) or (
            item is not None and self._carries_records(item)
        )

    def _check_plain(self, tp: Any) -> None:
        """A type the codec passes through must hold no record anywhere (a `dict[str, R]` would travel as
        pickled dataclasses, slowly, or not at all)."""
        if _holds_record(tp):
            raise TypeError(f"{self.root.__name__}: the records inside {tp} cannot cross the wire")


def _holds_record(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) or any(_holds_record(arg) for arg in typing.get_args(tp))


def _optional(tp: Any) -> Any | None:
    """T for `T | None`, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _list_item(tp: Any) -> Any | None:
    """T for `list[T]`, else None."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is list else None


# ---- framing ---------------------------------------------------------------------------------------


def frame(payload: Any) -> bytes:
    """One length-prefixed pickle."""
    data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def send(sock: socket.socket, payload: Any) -> None:
    sock.sendall(frame(payload))


def receive(sock: socket.socket) -> Any:
    """One message, blocking (the engine process's reader thread, and the parent before its loop runs)."""
    (size,) = HEADER.unpack(_exactly(sock, HEADER.size))
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, READ_SIZE))
        if not chunk:
            raise EOFError("the peer closed the engine socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class FrameReader:
    """Splits a non-blocking socket's bytes into messages (the event loop side): `feed` returns each
    complete message's payload bytes in order and keeps a partial one for the next read."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[Any]:
        buffer = self.buffer
        buffer += data
        start, size, messages = 0, len(buffer), []
        while size - start >= HEADER.size:
            (length,) = HEADER.unpack_from(buffer, start)
            end = start + HEADER.size + length
            if end > size:
                break
            with memoryview(buffer) as view:
                messages.append(pickle.loads(view[start + HEADER.size : end]))
            start = end
        del buffer[:start]
        return messages
