"""The engine in a process of its own (issue 9, item 5 prototype): the network side and the engine stop
sharing one GIL.

`ProcessEngine` is the `AsyncEngine` face the server uses (submit, abort, stats, tokenizer, ...), living
on the event loop of the network process. The `LLMEngine` runs in a child process (started with `spawn`),
driven there by the same `AsyncEngine._run` loop as in one process: a reader thread takes commands off a
socket pair into its command queue, and each iteration's `StepBatch` goes back as one length-prefixed
pickle whose deltas are plain tuples (a pickled slots dataclass costs a Python call per object; a tuple
of builtins is pickled in C). The loop reads the socket when it is readable and hands each batch to the
same `_deliver` as in one process, so sinks, accounts and frames are unchanged.

Not supported here: `call()` (functions run on the engine thread) and grammar pre-compilation off the
loop (the child compiles a request's grammar when it admits it).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable

from streamd.engine.async_engine import AsyncEngine, EngineCommand, Rejection, StepBatch, StopEngine
from streamd.engine.outputs import CompletionDelta, RequestDelta
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats

_HEADER = struct.Struct("<I")
_READ_SIZE = 1 << 20


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """What the child tells the network side once its engine is built."""

    model_name: str
    max_model_len: int
    tokenizer: Any
    stats: EngineStats
    pid: int
    thread_id: int


def _send(sock: socket.socket, payload: Any) -> None:
    data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _receive(sock: socket.socket) -> Any:
    """One message, blocking (the child's reader thread, and the parent before its loop runs)."""
    (size,) = _HEADER.unpack(_exactly(sock, _HEADER.size))
    return pickle.loads(_exactly(sock, size))


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, _READ_SIZE))
        if not chunk:
            raise EOFError("the peer closed the engine socket")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def encode_batch(batch: StepBatch) -> tuple[Any, ...]:
    rejected = [(r.request_id, _portable(r.error)) for r in batch.rejected]
    deltas = [(d.request_id, d.num_prompt_tokens, [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason,
                                                    c.logprobs, c.num_tokens) for c in d.outputs],
               d.finished, d.error, d.num_cached_tokens, d.queue_time) for d in batch.deltas]
    return batch.accepted, rejected, deltas, batch.stats, batch.dead


def decode_batch(wire: tuple[Any, ...]) -> StepBatch:
    accepted, rejected, deltas, stats, dead = wire
    return StepBatch(accepted, [Rejection(rid, error) for rid, error in rejected],
                     [RequestDelta(rid, prompt, [CompletionDelta(*c) for c in outputs], finished, error, cached, queue)
                      for rid, prompt, outputs, finished, error, cached, queue in deltas],
                     stats=stats, dead=dead)


def _portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(str(error))


# ---- the engine process --------------------------------------------------------------------------

class _ChildEngine(AsyncEngine):
    """The engine loop of `AsyncEngine`, publishing to the socket instead of an event loop."""

    def __init__(self, engine: Any, sock: socket.socket) -> None:
        super().__init__(engine)
        self._sock = sock

    def _publish(self, batch: StepBatch) -> None:
        try:
            _send(self._sock, encode_batch(batch))
        except OSError:  # the network process is gone; the engine loop stops at its StopEngine or EOF
            pass


def _child_main(factory: Callable[..., Any], args: tuple[Any, ...], commands: socket.socket,
                sock: socket.socket) -> None:
    from streamd import heap

    engine = factory(*args)
    child = _ChildEngine(engine, sock)
    heap.settle()
    _send(sock, EngineInfo(engine.model_name, engine.max_model_len, engine.tokenizer, engine.stats(),
                           multiprocessing.current_process().pid or 0, threading.get_native_id()))

    def read_commands() -> None:
        try:
            while True:
                child._commands.put(_receive(commands))
        except (EOFError, OSError):
            child._commands.put(StopEngine())

    threading.Thread(target=read_commands, name="streamd-engine-commands", daemon=True).start()
    child._run()


# ---- the network side ----------------------------------------------------------------------------

class _SocketCommands:
    """The command queue's `put`, across the socket (the child's reader thread always drains it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def put(self, command: EngineCommand) -> None:
        _send(self.sock, command)


class ProcessEngine(AsyncEngine):
    """`AsyncEngine` over an engine in a child process; `factory(*args)` builds the `LLMEngine` there."""

    def __init__(self, factory: Callable[..., Any], *args: Any) -> None:  # noqa: D107 (no super: no engine here)
        # Two socket pairs: commands (blocking sends; the child's reader thread always drains them) and
        # batches (read by the event loop when readable).
        commands, their_commands = socket.socketpair()
        ours, theirs = socket.socketpair()
        context = multiprocessing.get_context("spawn")
        self.process = context.Process(target=_child_main, args=(factory, args, their_commands, theirs),
                                       name="streamd-engine", daemon=True)
        self.process.start()
        their_commands.close()
        theirs.close()
        info: EngineInfo = _receive(ours)
        self.info = info
        self._sock = ours
        self._buffer = bytearray()
        self._tokenizer = info.tokenizer
        self._commands = _SocketCommands(commands)  # type: ignore[assignment]
        self._sinks = {}
        self._admissions = {}
        self._calls = set()
        self._loop = None
        self._thread = None
        self._stats = info.stats
        self._dead = None
        self.steps = 0

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def ready(self) -> bool:
        return self._loop is not None and self.process.is_alive() and self._dead is None

    @property
    def thread_id(self) -> int | None:
        return self.info.thread_id

    async def compile_grammar(self, params: SamplingParams) -> None:
        return None  # the engine process compiles it when it admits the request

    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        raise NotImplementedError("call() is not supported with the engine in its own process")

    async def shutdown(self) -> None:
        if self._loop is None:
            return
        for request_id in list(self._sinks):
            self.abort(request_id)
        self._commands.put(StopEngine())
        await self._loop.run_in_executor(None, self.process.join, 60)
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._loop = None

    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            assert self._loop is not None
            self._loop.remove_reader(self._sock.fileno())
            if self._dead is None:
                self._mark_dead("the engine process exited")
            return
        buffer = self._buffer
        buffer += data
        start, size = 0, len(buffer)
        while size - start >= _HEADER.size:
            (length,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + length
            if end > size:
                break
            with memoryview(buffer) as view:
                wire = pickle.loads(view[start + _HEADER.size:end])
            self._deliver(decode_batch(wire))
            start = end
        del buffer[:start]

