"""The engine process's side of `ProcessEngine`: the same `EngineLoop` as on a thread, fed from a socket
and publishing to one.

`child_main` (the spawned process's target) builds the engine, tells the network process what it needs
(`EngineInfo`), and runs `EngineLoop.run()` on its main thread with a `BatchSender` as its `publish`: each
iteration's `StepBatch` goes down the socket as one frame of the wire codec (wire.py). The sender publishes
at most `batches_ahead` batches ahead of their delivery; each delivered batch sends a `Delivered` credit
back. While the network side keeps up this bound is never reached; when it is the bottleneck, the batches
waiting for it merge into one write per stream, which is what lets it catch up, and the bound caps how many
steps merge.

Commands are read on one thread (credits take effect at once); `CommandRouter` sends a structured request's
add, and any later command for that request, through an admission thread that compiles its grammar (cached)
before the engine sees it, and every other command straight to the loop: a slow schema delays only its own
request, never a step or another request's abort.

With outputs made in the network process, the engine's output stage is an `UpdateRelay`
(`LLMEngine.use_output_stage`): it makes no deltas and keeps each step's `RequestUpdate`s for the batch that
carries them there.
"""

from __future__ import annotations

import queue
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamd.engine.client import wire
from streamd.engine.client.loop import STEP_BATCH_WIRE, AddRequest, EngineCommand, EngineLoop, StepBatch, StopEngine
from streamd.engine.output.output_processor import ProcessedStep
from streamd.engine.outputs import RequestUpdate
from streamd.engine.sample.grammar_budget import GrammarError, grammar_size
from streamd.engine.stats import EngineStats

if TYPE_CHECKING:
    from streamd.engine.llm_engine import LLMEngine
    from streamd.engine.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """What the engine process tells the network process once its engine is built."""

    model_name: str
    max_model_len: int
    tokenizer: Any
    initial_stats: EngineStats
    thread_id: int


@dataclass(slots=True, frozen=True)
class Delivered:
    """Network process -> engine: one more batch was handed to the sinks (a credit back)."""


DELIVERED_FRAME = wire.frame(Delivered())  # sent after every delivered batch: pickled once


class UpdateRelay:
    """The engine's `OutputStage` when outputs are made in the network process: keeps each step's updates for
    the batch that carries them there (no deltas, no stop hits here)."""

    def __init__(self) -> None:
        self.updates: list[RequestUpdate] = []

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float
    ) -> None:
        pass

    def process(self, updates: Iterable[RequestUpdate]) -> ProcessedStep:
        self.updates.extend(updates)
        return ProcessedStep()

    def take(self) -> list[RequestUpdate]:
        updates, self.updates = self.updates, []
        return updates


class BatchSender:
    """The engine loop's `publish` in the engine process: one wire frame per batch, at most
    `batches_ahead` of them not yet delivered."""

    def __init__(self, sock: socket.socket, batches_ahead: int, relay: UpdateRelay | None) -> None:
        self.sock = sock
        self.relay = relay
        self.credits = threading.Semaphore(batches_ahead)

    def __call__(self, batch: StepBatch) -> None:
        self.credits.acquire()  # waits while the network side is `batches_ahead` batches behind
        if self.relay is not None:
            batch.updates = self.relay.take()
        try:
            wire.send(self.sock, STEP_BATCH_WIRE.encode(batch))
        except OSError:  # the network process is gone; the engine loop stops at its StopEngine or EOF
            pass

    def release_all(self) -> None:
        """Nobody will deliver again: never wait for a credit."""
        self.credits.release(1 << 20)


class CommandRouter:
    """The engine process's commands on their way to the engine loop. A structured request's `AddRequest`
    waits on an admission thread (`admit`) while its grammar compiles (cached), never inside an engine
    step; every later command for that request follows it there, so none overtakes its add; every other
    command (aborts, pauses, stop-string finishes of running requests) goes straight to the loop, so a
    slow schema delays only its own request. Two admission lanes, a thread each: light specs
    (`grammar_size(spec).light`: they compile in milliseconds) and heavy ones, so a trivial schema never
    queues behind big ones. `StopEngine` passes the light lane, then the heavy one: it goes last, after
    every pending admission."""

    def __init__(self, engine: LLMEngine, commands: queue.SimpleQueue[EngineCommand]) -> None:
        self.engine = engine
        self.commands = commands
        self.light: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self.heavy: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self.queued: dict[str, _Queued] = {}  # request id -> its commands waiting in their lane
        self.lock = threading.Lock()

    def route(self, command: EngineCommand) -> None:
        request_id: str | None = getattr(command, "request_id", None)
        with self.lock:  # a check and its put together: `admit` cannot empty a request's queue in between
            if request_id is not None and (_structured(command) or request_id in self.queued):
                queued = self.queued.get(request_id) or self.queued.setdefault(request_id, _Queued(self._lane(command)))
                queued.count += 1
                queued.lane.put(command)
                return
            if isinstance(command, StopEngine):
                self.light.put(command)
                return
        self.commands.put(command)

    def admit(self) -> None:
        """The heavy lane's admission thread."""
        self._admit(self.heavy, None)

    def admit_light(self) -> None:
        """The light lane's admission thread (it hands `StopEngine` on to the heavy lane)."""
        self._admit(self.light, self.heavy)

    def _admit(self, lane: queue.SimpleQueue[EngineCommand], then: queue.SimpleQueue[EngineCommand] | None) -> None:
        """Compiles, then hands each queued command of `lane` to the loop in order."""
        while True:
            command = lane.get()
            if isinstance(command, AddRequest):
                try:
                    self.engine.compile_grammar(command.params)
                except Exception:  # the engine refuses it at admission, naming why
                    pass
            if isinstance(command, StopEngine) and then is not None:
                then.put(command)
                return
            with self.lock:
                self.commands.put(command)
                self._dequeued(getattr(command, "request_id", None))
            if isinstance(command, StopEngine):
                return

    def _lane(self, command: EngineCommand) -> queue.SimpleQueue[EngineCommand]:
        """A structured add's lane: light unless its spec is heavy (one that cannot be measured fails fast)."""
        assert isinstance(command, AddRequest) and command.params.structured_outputs is not None
        try:
            light = grammar_size(command.params.structured_outputs).light
        except GrammarError:
            light = True
        return self.light if light else self.heavy

    def _dequeued(self, request_id: str | None) -> None:
        queued = self.queued.get(request_id) if request_id is not None else None
        if queued is not None:
            queued.count -= 1
            if not queued.count:
                del self.queued[request_id]  # type: ignore[arg-type]


@dataclass(slots=True)
class _Queued:
    """A request's commands waiting in an admission lane (all in its add's lane)."""

    lane: queue.SimpleQueue[EngineCommand]
    count: int = 0


def _structured(command: EngineCommand) -> bool:
    return isinstance(command, AddRequest) and command.params.structured_outputs is not None


def child_main(
    factory: Callable[..., LLMEngine],
    args: tuple[Any, ...],
    outputs_here: bool,
    batches_ahead: int,
    commands: socket.socket,
    batches: socket.socket,
) -> None:
    """The engine process: builds the engine, then runs its loop until `StopEngine` or the parent is gone."""
    from streamd import heap

    # The network process owns the lifecycle (a terminal's Ctrl-C or SIGTERM reaches the whole process
    # group): the engine stops on its StopEngine, or when the network process's socket closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = factory(*args)
    relay = None if outputs_here else UpdateRelay()
    if relay is not None:
        engine.use_output_stage(relay)
    sender = BatchSender(batches, batches_ahead, relay)
    loop = EngineLoop(engine, sender)
    heap.settle()
    info = EngineInfo(
        engine.model_name, engine.max_model_len, engine.tokenizer, engine.stats(), threading.get_native_id()
    )
    wire.send(batches, info)
    router = CommandRouter(engine, loop.commands)
    threading.Thread(
        target=_read_commands, args=(commands, router, sender), name="streamd-engine-commands", daemon=True
    ).start()
    threading.Thread(target=router.admit, name="streamd-engine-admissions", daemon=True).start()
    threading.Thread(target=router.admit_light, name="streamd-engine-light-admissions", daemon=True).start()
    loop.run()


def _read_commands(sock: socket.socket, router: CommandRouter, sender: BatchSender) -> None:
    """Credits take effect at once; every other command goes through `router`."""
    try:
        while True:
            command = wire.receive(sock)
            if isinstance(command, Delivered):
                sender.credits.release()
            else:
                router.route(command)
    except (EOFError, OSError):  # the network process is gone: stop, never wait for its credits again
        router.route(StopEngine())
        sender.release_all()
