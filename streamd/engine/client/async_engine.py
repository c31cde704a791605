"""AsyncEngine: runs `LLMEngine.step()` on one dedicated thread and hands the deltas to asyncio.

The engine thread owns the `LLMEngine`; nothing else touches it. The event loop talks to it through a
thread-safe queue of typed commands (`AddRequest`, `AbortRequest`, `PauseRequest`, `CallEngine`,
`StopEngine`), and the thread answers with one `loop.call_soon_threadsafe` per iteration carrying
everything that iteration produced (`StepBatch`): admission results, the step's deltas and a stats
snapshot. When no request can progress (none unfinished, or all paused) the thread blocks on the queue,
until a command or the next request deadline, so an idle server costs nothing.

Each request's deltas go to its `DeltaSink` (a `RequestStream`, or a connection's outbox that writes the
deltas of many requests together). Deltas are produced once, by the engine's output processor; this
module only moves them across the thread boundary.

A step that raises fails every request in flight with an error and the engine frees them; if the engine
cannot even do that, it is marked dead (`ready` turns False) and further requests are refused.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamd.engine.client.request_stream import DeltaSink, RequestStream
from streamd.engine.outputs import RequestDelta
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats
from streamd.logs import get_logger

if TYPE_CHECKING:
    from streamd.engine.llm_engine import LLMEngine

logger = get_logger(__name__)

# Consecutive failed steps after which the engine is declared dead instead of retried.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine thread stopped or could not recover from a failed step."""

    code = "engine_unavailable"


class DuplicateRequestError(ValueError):
    code = "duplicate_id"


# ---- commands (loop -> engine thread) -----------------------------------------------------------


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
class CallEngine:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]


@dataclass(slots=True, frozen=True)
class StopEngine:
    pass


EngineCommand = AddRequest | AbortRequest | PauseRequest | CallEngine | StopEngine


# ---- what one iteration hands to the loop ---------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Rejection:
    request_id: str
    error: BaseException


@dataclass(slots=True, frozen=True)
class CallResult:
    future: asyncio.Future[Any]
    value: Any = None
    error: BaseException | None = None


@dataclass(slots=True)
class StepBatch:
    accepted: list[str] = field(default_factory=list)
    rejected: list[Rejection] = field(default_factory=list)
    deltas: list[RequestDelta] = field(default_factory=list)
    calls: list[CallResult] = field(default_factory=list)
    stats: EngineStats | None = None
    dead: str | None = None

    def __bool__(self) -> bool:
        return bool(self.accepted or self.rejected or self.deltas or self.calls or self.stats or self.dead)


class AsyncEngine:
    """The asyncio face of an `LLMEngine`. Call `start()` from the event loop that will consume it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._commands: queue.SimpleQueue[EngineCommand] = queue.SimpleQueue()
        self._sinks: dict[str, DeltaSink] = {}
        self._admissions: dict[str, asyncio.Future[None]] = {}
        self._calls: set[asyncio.Future[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats: EngineStats = engine.stats()
        self._dead: str | None = None
        self.steps = 0  # engine iterations that ran a step (tests use it to see that idle means idle)

    # ---- loop side -------------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        """The event loop's own copy of the engine's tokenizer: a Hugging Face fast tokenizer must not be
        used from two threads at once, and the engine thread decodes with the original."""
        return self._tokenizer

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles (and caches) the request's grammar on a worker thread, so a slow schema never blocks
        the event loop; raises GrammarError naming what is wrong, before the request is submitted."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.compile_grammar, params)

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def thread_id(self) -> int | None:
        """The engine thread's native id (benchmarks read its CPU time from the OS)."""
        return self._thread.native_id if self._thread is not None else None

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: the last stats snapshot plus adds the thread has not taken yet."""
        return self._stats.scheduler.num_waiting + len(self._admissions)

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (exact once idle)."""
        return self._stats

    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._run, name="streamd-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Aborts everything in flight and stops the thread."""
        if self._thread is None:
            return
        self._stop_engine()
        thread, self._thread = self._thread, None
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    def _stop_engine(self) -> None:
        """Aborts every request in flight, then tells the engine loop to stop (after their final deltas)."""
        for request_id in list(self._sinks):
            self.abort(request_id)
        self._commands.put(StopEngine())

    async def add_request(
        self, request_id: str, prompt: str | None, params: SamplingParams, *, prompt_token_ids: list[int] | None = None
    ) -> RequestStream:
        """Admits a request and returns its stream; raises the engine's RequestError/ValueError if refused."""
        stream = RequestStream(request_id, self.abort)
        await self.submit(request_id, prompt, params, stream, prompt_token_ids=prompt_token_ids)
        return stream

    async def submit(
        self,
        request_id: str,
        prompt: str | None,
        params: SamplingParams,
        sink: DeltaSink,
        *,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Admits a request whose deltas go to `sink`; returns once admitted, raises if refused. A task
        cancelled while waiting aborts the request."""
        if not self.ready:
            raise EngineDeadError(self._dead or "the engine is not running")
        if request_id in self._sinks:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sinks[request_id] = sink
        self._admissions[request_id] = admitted
        self._commands.put(AddRequest(request_id, prompt, params, prompt_token_ids, time.monotonic()))
        try:
            await asyncio.shield(admitted)
        except asyncio.CancelledError:
            self.abort(request_id)  # admitted or not, the engine will let go of it
            raise

    def abort(self, request_id: str) -> None:
        """Asks the engine to abort a request; its sink then gets a final delta (unless already done)."""
        self._commands.put(AbortRequest(request_id))

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stops (True) or restarts (False) scheduling a request whose consumer fell behind / caught up."""
        self._commands.put(PauseRequest(request_id, paused))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps (exact stats, test references)."""
        if not self.ready:
            raise EngineDeadError(self._dead or "the engine is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)
        self._commands.put(CallEngine(fn, future))
        return await future

    async def wait_idle(self, timeout: float = 60.0) -> EngineStats:
        """Waits until no request is in flight (the engine's own view); returns its exact stats then."""
        async with asyncio.timeout(timeout):
            while True:
                # A call runs at the start of an engine iteration, so while the engine is busy each
                # round trip waits for one step: this polls at the step rate, never faster.
                busy, stats = await self.call(lambda e: (e.has_unfinished_requests(), e.stats()))
                if not busy and not self._sinks:
                    return stats

    def _deliver(self, batch: StepBatch) -> None:
        """Loop side of the one call per iteration."""
        for request_id in batch.accepted:
            future = self._admissions.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(None)
        for rejection in batch.rejected:
            self._sinks.pop(rejection.request_id, None)
            future = self._admissions.pop(rejection.request_id, None)
            if future is not None and not future.done():
                future.set_exception(rejection.error)
        sinks = self._sinks
        for delta in batch.deltas:
            sink = sinks.get(delta.request_id)
            if sink is not None:
                if delta.finished:
                    del sinks[delta.request_id]
                sink.put(delta)
        for call in batch.calls:
            if not call.future.done():
                if call.error is not None:
                    call.future.set_exception(call.error)
                else:
                    call.future.set_result(call.value)
        if batch.stats is not None:
            self._stats = batch.stats
        if batch.dead is not None:
            self._mark_dead(batch.dead)

    def _mark_dead(self, reason: str) -> None:
        self._dead = reason
        for future in self._admissions.values():
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for request_id, sink in self._sinks.items():
            sink.put(RequestDelta(request_id, 0, [], finished=True, error=reason))
        for future in list(self._calls):
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._admissions.clear()
        self._sinks.clear()

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        failures = 0
        try:
            while True:
                batch = StepBatch()
                if not self._take_commands(batch, block=not engine.has_runnable_work()):
                    return
                if engine.has_unfinished_requests():
                    failures = self._step(batch, failures)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        batch.dead = "the engine failed repeatedly and stopped"
                if batch:
                    self._publish(batch)
                if batch.dead is not None:
                    return
        except BaseException as exc:  # the thread must never die silently
            logger.exception("engine_thread_crashed")
            self._publish(StepBatch(dead=f"engine thread crashed: {exc!r}"))

    def _take_commands(self, batch: StepBatch, block: bool) -> bool:
        """Runs queued commands; returns False to stop the thread."""
        command = self._wait_command() if block else self._get_nowait()
        while command is not None:
            match command:
                case AddRequest():
                    self._add(batch, command)
                case AbortRequest(request_id):
                    self._abort(request_id)
                case PauseRequest(request_id, paused):
                    self.engine.set_paused(request_id, paused)
                case CallEngine(fn, future):
                    try:
                        batch.calls.append(CallResult(future, fn(self.engine)))
                    except Exception as exc:
                        batch.calls.append(CallResult(future, error=exc))
                    batch.stats = self.engine.stats()
                case StopEngine():
                    self._stop(batch)
                    return False
            command = self._get_nowait()
        return True

    def _wait_command(self) -> EngineCommand | None:
        """The next command; None when the earliest request deadline comes first (a step expires it)."""
        deadline = self.engine.next_deadline
        if deadline is None:
            return self._commands.get()
        try:
            return self._commands.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None

    def _get_nowait(self) -> EngineCommand | None:
        try:
            return self._commands.get_nowait()
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

    def _step(self, batch: StepBatch, failures: int) -> int:
        try:
            batch.deltas.extend(self.engine.step())
        except Exception as exc:
            logger.exception("engine_step_failed", in_flight=self.engine.stats().num_requests)
            self._fail_all(batch, f"engine step failed: {exc!r}")
            return failures + 1
        self.steps += 1
        batch.stats = self.engine.stats()
        return 0

    def _fail_all(self, batch: StepBatch, message: str) -> None:
        """Fails every request in flight; the engine frees them. If it cannot, the engine is dead."""
        try:
            batch.deltas.extend(self.engine.abort_all(message))
            batch.stats = self.engine.stats()
        except Exception:
            logger.exception("abort_all_failed")
            batch.dead = f"{message}; the engine could not free its requests"

    def _stop(self, batch: StepBatch) -> None:
        while self.engine.has_unfinished_requests():
            if self._step(batch, 0):
                break
        batch.dead = "the engine was shut down"
        self._publish(batch)

    def _publish(self, batch: StepBatch) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop closed between the check and the call
            pass
