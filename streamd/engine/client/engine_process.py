"""The engine in a process of its own (issue 9, item 5 prototype): the network side and the engine stop
sharing one GIL.

`ProcessEngine` is the `AsyncEngine` face the server uses (submit, abort, stats, tokenizer, ...), living
on the event loop of the network process. The `LLMEngine` runs in a child process (started with `spawn`),
driven there by the same `AsyncEngine._run` loop as in one process: a reader thread takes commands off a
socket pair into its command queue, and each iteration's `StepBatch` goes back as one length-prefixed
pickle whose deltas are plain tuples (a pickled slots dataclass costs a Python call per object; a tuple
of builtins is pickled in C). The loop reads the socket when it is readable and hands each batch to the
same `_deliver` as in one process, so sinks, accounts and frames are unchanged. The engine publishes at
most `batches_ahead` batches ahead of their delivery (`engine.batches_ahead`; each delivered batch
sends a `Delivered` credit back). While the network side keeps up this bound is never reached; when it is
the bottleneck, the batches waiting for it merge into one write per stream (a stream's tokens of several
steps in one frame or SSE event), which is what lets it catch up, and the bound caps how many steps merge.
Measured at 256 streams on 2 cores (null model, median of 3, served/offline): 8 ahead, WebSocket 0.76, SSE
0.62; 16 ahead (the default), 0.87 and 0.64 with ITL p99 11 / 25 ms; 32 ahead, no better; with 2 ahead a
single run gave SSE 85k tok/s against 106k at 8; unbounded, ITL p50 87 ms (benchmarks/NOTES.md).

With `outputs="network"` the output processor (detokenizer, stop strings, deltas) runs in the network
process instead, as in engines whose front end detokenizes: the child sends each step's `RequestUpdate`s
(new token ids per sequence) and the network process turns them into deltas; a choice that a stop string
ended is finished in the engine by a `StopChoice` command, a step or two later (the tokens sampled
meanwhile are void to the output processor, as when the engine finishes it itself).

The child reads commands on one thread (credits take effect at once); `CommandRouter` sends a structured
request's add, and any later command for that request, through an admission thread that compiles its grammar
(cached) before the engine sees it, and every other command straight on: a slow schema delays only its own
request, never a step or another request's abort. Not supported here: `call()` (functions run on the engine thread),
refusing a bad grammar before submission (the engine refuses it at admission, naming why) and tensor
parallelism.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle
import queue
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamd.engine.client.async_engine import (
    AddRequest,
    AsyncEngine,
    CallEngine,
    EngineCommand,
    EngineDeadError,
    Rejection,
    StepBatch,
    StopEngine,
)
from streamd.engine.output.output_processor import OutputProcessor, ProcessedStep
from streamd.engine.outputs import CompletionDelta, RequestDelta, RequestUpdate, SeqUpdate
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats

_HEADER = struct.Struct("<I")
_READ_SIZE = 1 << 20


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """What the child tells the network side once its engine is built; it stands in for the engine in
    `AsyncEngine.__init__` and the loop side's `model_name`/`max_model_len`."""

    model_name: str
    max_model_len: int
    tokenizer: Any
    initial_stats: EngineStats
    thread_id: int

    def stats(self) -> EngineStats:
        return self.initial_stats


@dataclass(slots=True, frozen=True)
class Delivered:
    """Network process -> engine: one more batch was handed to the sinks (a credit back)."""


@dataclass(slots=True, frozen=True)
class StopChoice:
    """Network process -> engine: a stop string ended this choice (outputs in the network process)."""

    request_id: str
    index: int


def _frame(payload: Any) -> bytes:
    """One length-prefixed pickle."""
    data = pickle.dumps(payload, pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _send(sock: socket.socket, payload: Any) -> None:
    sock.sendall(_frame(payload))


DELIVERED_FRAME = _frame(Delivered())  # sent after every delivered batch: pickled once


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


def encode_batch(batch: StepBatch, updates: list[RequestUpdate]) -> tuple[Any, ...]:
    rejected = [(r.request_id, _portable(r.error)) for r in batch.rejected]
    deltas = [
        (
            d.request_id,
            d.num_prompt_tokens,
            [
                (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs, c.num_tokens)
                for c in d.outputs
            ],
            d.finished,
            d.error,
            d.num_cached_tokens,
            d.queue_time,
        )
        for d in batch.deltas
    ]
    news = [
        (
            u.request_id,
            [(q.index, q.token_ids, q.logprobs, q.finish_reason, q.stop_token_id) for q in u.seqs],
            u.num_cached_tokens,
            u.scheduled_time,
            u.error,
        )
        for u in updates
    ]
    return batch.accepted, rejected, deltas, news, batch.stats, batch.dead


def decode_batch(wire: tuple[Any, ...]) -> tuple[StepBatch, list[RequestUpdate]]:
    accepted, rejected, deltas, news, stats, dead = wire
    batch = StepBatch(
        accepted,
        [Rejection(rid, error) for rid, error in rejected],
        [
            RequestDelta(rid, prompt, [CompletionDelta(*c) for c in outputs], finished, error, cached, queue)
            for rid, prompt, outputs, finished, error, cached, queue in deltas
        ],
        stats=stats,
        dead=dead,
    )
    updates = [
        RequestUpdate(rid, [SeqUpdate(*q) for q in seqs], cached, scheduled, error)
        for rid, seqs, cached, scheduled, error in news
    ]
    return batch, updates


def _portable(error: BaseException) -> BaseException:
    """The error itself if it survives pickling, else a RuntimeError with its message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(str(error))


# ---- the engine process --------------------------------------------------------------------------


class _UpdateRelay:
    """Stands in for the engine's output processor when outputs are made in the network process: keeps
    each step's updates for the batch that carries them there (no deltas, no stop hits here)."""

    def __init__(self) -> None:
        self.updates: list[RequestUpdate] = []

    def add_request(self, *args: Any) -> None:
        pass

    def process(self, updates: list[RequestUpdate]) -> ProcessedStep:
        self.updates.extend(updates)
        return ProcessedStep()

    def take(self) -> list[RequestUpdate]:
        updates, self.updates = self.updates, []
        return updates


class _ChildEngine(AsyncEngine):
    """The engine loop of `AsyncEngine`, publishing to the socket instead of an event loop."""

    def __init__(self, engine: Any, sock: socket.socket, relay: _UpdateRelay | None, batches_ahead: int) -> None:
        super().__init__(engine)
        self._sock = sock
        self._relay = relay
        self.credits = threading.Semaphore(batches_ahead)

    def _publish(self, batch: StepBatch) -> None:
        self.credits.acquire()  # waits while the network side is `batches_ahead` batches behind
        try:
            _send(self._sock, encode_batch(batch, self._relay.take() if self._relay is not None else []))
        except OSError:  # the network process is gone; the engine loop stops at its StopEngine or EOF
            pass


def _child_main(
    factory: Callable[..., Any],
    args: tuple[Any, ...],
    outputs_here: bool,
    batches_ahead: int,
    commands: socket.socket,
    sock: socket.socket,
) -> None:
    from streamd import heap

    # The network process owns the lifecycle (a terminal's Ctrl-C or SIGTERM reaches the whole process
    # group): the engine stops on its StopEngine, or when the network process's socket closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = factory(*args)
    relay = None if outputs_here else _UpdateRelay()
    if relay is not None:
        engine.output_processor = relay
    child = _ChildEngine(engine, sock, relay, batches_ahead)
    heap.settle()
    _send(
        sock,
        EngineInfo(
            engine.model_name, engine.max_model_len, engine.tokenizer, engine.stats(), threading.get_native_id()
        ),
    )

    router = CommandRouter(engine, child._commands)

    def read_commands() -> None:  # credits take effect at once; every other command goes through `router`
        try:
            while True:
                command = _receive(commands)
                if isinstance(command, Delivered):
                    child.credits.release()
                else:
                    router.route(command)
        except (EOFError, OSError):  # the network process is gone: stop, never wait for its credits again
            router.route(StopEngine())
            child.credits.release(1 << 20)

    threading.Thread(target=read_commands, name="streamd-engine-commands", daemon=True).start()
    threading.Thread(target=router.admit, name="streamd-engine-admissions", daemon=True).start()
    child._run()


class CommandRouter:
    """The engine process's commands on their way to the engine loop. A structured request's `AddRequest`
    waits on the admission thread (`admit`) while its grammar compiles (cached), never inside an engine
    step; every later command for that request follows it there, so none overtakes its add; every other
    command (aborts, pauses, stop-string finishes of running requests) goes straight to the engine, so a
    slow schema delays only its own request. `StopEngine` goes last, after every pending admission."""

    def __init__(self, engine: Any, commands: queue.SimpleQueue[EngineCommand]) -> None:
        self.engine = engine
        self.commands = commands
        self.admissions: queue.SimpleQueue[EngineCommand | StopChoice] = queue.SimpleQueue()
        self.queued: dict[str, int] = {}  # request id -> its commands waiting on the admission thread
        self.lock = threading.Lock()

    def route(self, command: EngineCommand | StopChoice) -> None:
        request_id = getattr(command, "request_id", None)
        with self.lock:  # a check and its put together: `admit` cannot empty a request's queue in between
            structured = isinstance(command, AddRequest) and command.params.structured_outputs is not None
            if structured or request_id in self.queued:
                self.queued[request_id] = self.queued.get(request_id, 0) + 1
                self.admissions.put(command)
                return
            if isinstance(command, StopEngine):
                self.admissions.put(command)
                return
        self.commands.put(_finish_choice(command) if isinstance(command, StopChoice) else command)

    def admit(self) -> None:
        """The admission thread: compiles, then hands each queued command to the engine in order."""
        while True:
            command = self.admissions.get()
            if isinstance(command, AddRequest):
                try:
                    self.engine.compile_grammar(command.params)
                except Exception:
                    pass
            with self.lock:
                self.commands.put(_finish_choice(command) if isinstance(command, StopChoice) else command)
                request_id = getattr(command, "request_id", None)
                if request_id in self.queued:
                    self.queued[request_id] -= 1
                    if not self.queued[request_id]:
                        del self.queued[request_id]
            if isinstance(command, StopEngine):
                return


def _finish_choice(stop: StopChoice) -> CallEngine:
    """The engine-thread call that ends a choice (its result goes nowhere)."""
    return CallEngine(lambda engine: engine.finish_choice(stop.request_id, stop.index), None)  # type: ignore[arg-type]


# ---- the network side ----------------------------------------------------------------------------


class _SocketCommands:
    """The command queue's `put`, across the socket (the child's reader thread always drains it)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def put(self, command: EngineCommand) -> None:
        _send(self.sock, command)


class ProcessEngine(AsyncEngine):
    """`AsyncEngine` over an engine in a child process; `factory(*args)` builds the `LLMEngine` there.
    `outputs`: "engine" (deltas made in the child) or "network" (made here from the child's updates);
    `batches_ahead`: how many step batches the engine may publish before this side has delivered them."""

    def __init__(self, factory: Callable[..., Any], *args: Any, outputs: str, batches_ahead: int) -> None:
        # Two socket pairs: commands (blocking sends; the child's reader thread always drains them) and
        # batches (read by the event loop when readable).
        commands, their_commands = socket.socketpair()
        ours, theirs = socket.socketpair()
        context = multiprocessing.get_context("spawn")
        if outputs not in ("engine", "network"):
            raise ValueError(f"outputs must be 'engine' or 'network', not {outputs!r}")
        if batches_ahead < 1:
            raise ValueError(f"batches_ahead must be at least 1, not {batches_ahead}")
        self.process = context.Process(
            target=_child_main,
            args=(factory, args, outputs == "engine", batches_ahead, their_commands, theirs),
            name="streamd-engine",
            daemon=True,
        )
        self.process.start()
        their_commands.close()
        theirs.close()
        info: EngineInfo = _receive(ours)
        super().__init__(info)  # type: ignore[arg-type]  # the loop side reads only what EngineInfo holds
        self.info = info
        self._sock = ours
        self._buffer = bytearray()
        self._command_sock = commands
        self._commands = _SocketCommands(commands)  # type: ignore[assignment]
        self.outputs = OutputProcessor(info.tokenizer) if outputs == "network" else None
        self._prompts: dict[str, tuple[list[int], SamplingParams, float]] = {}  # submitted, not yet admitted

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

    async def submit(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        sink: Any,
        *,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        if self.outputs is not None and request_id not in self._sinks:
            if prompt_token_ids is None and isinstance(prompt, str):
                # Tokenized once, here (as LLMEngine tokenizes a text prompt): the child takes these ids
                # and keeps the text, instead of tokenizing it again on the engine's side of the split.
                prompt_token_ids = list(self._tokenizer(prompt).input_ids)
            self._prompts[request_id] = (list(prompt_token_ids or []), params, time.monotonic())
        try:
            await super().submit(request_id, prompt, params, sink, prompt_token_ids=prompt_token_ids)
        except EngineDeadError:  # never sent; a refusal or a later admission pops it when it arrives
            self._prompts.pop(request_id, None)
            raise

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        raise NotImplementedError("call() is not supported with the engine in its own process")

    async def shutdown(self) -> None:
        if self._loop is None:
            return
        self._stop_engine()
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
                wire = pickle.loads(view[start + _HEADER.size : end])
            self._deliver(self._with_deltas(*decode_batch(wire)))
            try:
                self._command_sock.sendall(DELIVERED_FRAME)
            except OSError:  # the engine process is gone; the socket's end marks the engine dead
                pass
            start = end
        del buffer[:start]

    def _with_deltas(self, batch: StepBatch, updates: list[RequestUpdate]) -> StepBatch:
        """Outputs made here: admitted requests join the output processor, the updates become the
        batch's deltas, and choices a stop string ended are finished in the engine."""
        outputs = self.outputs
        if outputs is None:
            return batch
        for request_id in batch.accepted:
            ids, params, arrival = self._prompts.pop(request_id)
            outputs.add_request(request_id, ids, params, arrival)
        for rejection in batch.rejected:
            self._prompts.pop(rejection.request_id, None)
        processed = outputs.process(updates)
        batch.deltas = processed.deltas
        for hit in processed.stop_hits:
            self._commands.put(StopChoice(hit.request_id, hit.index))
        return batch
