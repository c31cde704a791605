"""The engine loop: the one place that drives an `LLMEngine` (commands, step, publish), on a thread of the
server process or on the main thread of an engine process alike.

`EngineLoop` owns its engine; nothing else touches it. Commands arrive on a thread-safe queue
(`AddRequest`, `AbortRequest`, `PauseRequest`, `FinishChoice`, `CallEngine`, `StopEngine`); each
iteration runs the queued commands, steps once if a request is unfinished, and hands what the iteration
produced (`StepBatch`: admissions, the step's deltas, a stats snapshot) to the `publish` callable it was
built with: what the commands produced before the step (so an admission is never held for a step), the
step's after it; each thing exactly once. Where the batch goes is the caller's: the thread client posts it
to its event loop, the engine process sends it down a socket. When no request can progress (none
unfinished, or all paused) the loop blocks on the queue, until a command or the next request deadline, so
an idle engine costs nothing.

A step that raises fails every request in flight with an error and the engine frees them; if the engine
cannot even do that, or steps fail `MAX_CONSECUTIVE_STEP_FAILURES` times in a row, the batch says the engine
is dead and the loop ends.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamd.engine.client.wire import LOCAL, Codec
from streamd.engine.outputs import RequestDelta, RequestUpdate
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats
from streamd.logs import get_logger

if TYPE_CHECKING:
    from streamd.engine.llm_engine import LLMEngine

logger = get_logger(__name__)

# Consecutive failed steps after which the engine is declared dead instead of retried.
MAX_CONSECUTIVE_STEP_FAILURES = 3


# ---- commands (client -> engine loop) ------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class AddRequest:
    request_id: str
    prompt: str | None
    params: SamplingParams
    prompt_token_ids: list[int] | None
    arrival_time: float


@dataclass(slots=True, frozen=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True, frozen=True)
class PauseRequest:
    request_id: str
    paused: bool


@dataclass(slots=True, frozen=True)
class FinishChoice:
    """A stop string ended this choice (outputs made outside the engine): the engine finishes it."""

    request_id: str
    index: int


@dataclass(slots=True, frozen=True)
class CallEngine:
    """Runs `fn(engine)` between steps; its result comes back with the batch, for `future` (loop-local:
    only a client in the engine's own process can send one)."""

    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


@dataclass(slots=True, frozen=True)
class StopEngine:
    pass


EngineCommand = AddRequest | AbortRequest | PauseRequest | FinishChoice | CallEngine | StopEngine


# ---- what one iteration publishes ------------------------------------------------------------------


@dataclass(slots=True)
class Rejection:
    request_id: str
    error: BaseException


@dataclass(slots=True)
class CallResult:
    future: asyncio.Future[Any]
    value: Any = None
    error: BaseException | None = None


@dataclass(slots=True)
class StepBatch:
    """Everything one iteration produced. `updates` carries the step's raw token news instead of deltas
    when the output processor runs in another process; `calls` never leaves the engine's process."""

    accepted: list[str] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    deltas: list[RequestDelta] = field(default_factory=list)
    updates: list[RequestUpdate] = field(default_factory=list)
    stats: EngineStats | None = None
    dead: str | None = None
    calls: list[CallResult] = field(default_factory=list, metadata=LOCAL)

    def __bool__(self) -> bool:
        return bool(
            self.accepted or self.rejected or self.deltas or self.updates or self.calls or self.stats or self.dead
        )


STEP_BATCH_WIRE = Codec(StepBatch)  # how a batch crosses to another process (wire.py)


class EngineLoop:
    """Drives one `LLMEngine`: `run()` on the thread that owns it; `put(command)` from any thread."""

    def __init__(self, engine: LLMEngine, publish: Callable[[StepBatch], None]) -> None:
        self.engine = engine
        self.publish = publish
        self.commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self.steps = 0  # iterations that ran a step (tests use it to see that idle means idle)
        self._failures = 0  # consecutive failed steps

    def put(self, command: EngineCommand) -> None:
        self.commands.put(command)

    def run(self) -> None:
        """Iterates until `StopEngine` or death; the loop never dies silently."""
        try:
            while self._iterate():
                pass
        except BaseException as exc:
            logger.exception("engine_thread_crashed")
            self.publish(StepBatch(dead=f"engine thread crashed: {exc!r}"))

    def _iterate(self) -> bool:
        """One iteration: commands, a step, its publish; False once the loop must end. What the commands
        produced (admissions above all) is published before the step, not with it: a request's admission,
        and so its response's head and first frame, never waits for a step (a long prefill, its own)."""
        engine, batch = self.engine, StepBatch()
        running = self._take_commands(batch, block=not engine.has_runnable_work())
        if running and engine.has_unfinished_requests():
            if batch:
                self.publish(batch)
                batch = StepBatch()
            self._step(batch)
            if self._failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                batch.dead = "the engine failed repeatedly and stopped"
        if batch:
            self.publish(batch)
        return running and batch.dead is None

    def _take_commands(self, batch: StepBatch, block: bool) -> bool:
        """Runs the queued commands; False after `StopEngine` (the batch then holds the final deltas)."""
        command = self._wait_command() if block else self._get_nowait()
        while command is not None:
            if isinstance(command, StopEngine):
                self._finish(batch)
                return False
            self._run_command(batch, command)
            command = self._get_nowait()
        return True

    def _run_command(self, batch: StepBatch, command: EngineCommand) -> None:
        match command:
            case AddRequest():
                self._add(batch, command)
            case AbortRequest(request_id):
                self._abort(request_id)
            case PauseRequest(request_id, paused):
                self.engine.set_paused(request_id, paused)
            case FinishChoice(request_id, index):
                self.engine.finish_choice(request_id, index)
                batch.stats = self.engine.stats()
            case CallEngine(fn, future):
                try:
                    batch.calls.append(CallResult(future, fn(self.engine)))
                except Exception as exc:
                    batch.calls.append(CallResult(future, error=exc))
                batch.stats = self.engine.stats()

    def _wait_command(self) -> EngineCommand | None:
        """The next command; None when the earliest request deadline comes first (a step expires it)."""
        deadline = self.engine.next_deadline
        if deadline is None:
            return self.commands.get()
        try:
            return self.commands.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def _get_nowait(self) -> EngineCommand | None:
        try:
            return self.commands.get_nowait()
        except queue.Empty:
            return None

    def _add(self, batch: StepBatch, command: AddRequest) -> None:
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                prompt_token_ids=command.prompt_token_ids,
                arrival_time=command.arrival_time,
            )
        except Exception as exc:
            batch.rejected.append(Rejection(command.request_id, exc))
            return
        batch.accepted.append(command.request_id)

    def _abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort_failed", request_id=request_id)

    def _step(self, batch: StepBatch) -> bool:
        """One engine step into the batch; False (and every request failed) if it raised."""
        try:
            batch.deltas.extend(self.engine.step())
        except Exception as exc:
            logger.exception("engine_step_failed", in_flight=self.engine.stats().num_requests)
            self._fail_all(batch, f"engine step failed: {exc!r}")
            self._failures += 1
            return False
        self.steps += 1
        self._failures = 0
        batch.stats = self.engine.stats()
        return True

    def _fail_all(self, batch: StepBatch, message: str) -> None:
        """Fails every request in flight; the engine frees them. If it cannot, the engine is dead."""
        try:
            batch.deltas.extend(self.engine.abort_all(message))
            batch.stats = self.engine.stats()
        except Exception:
            logger.exception("abort_all_failed")
            batch.dead = f"{message}; the engine could not free its requests"

    def _finish(self, batch: StepBatch) -> None:
        """`StopEngine`: steps until the requests aborted before it have their final deltas."""
        while self.engine.has_unfinished_requests():
            if not self._step(batch):
                break
        self.engine.close()
        batch.dead = "the engine was shut down"
