"""AsyncEngine: runs `LLMEngine.step()` on one dedicated thread and hands the outputs to asyncio.

The engine thread owns the `LLMEngine`; nothing else touches it. The event loop talks to it through a
thread-safe command queue (add, abort, call), and the thread answers with one
`loop.call_soon_threadsafe` per iteration carrying everything that iteration produced: admission
results, per-request deltas and a stats snapshot. When no request is unfinished the thread blocks on
the queue, so an idle server costs nothing.

Deltas (the text and token ids new since the previous step) are cut on the engine thread, where the
cumulative `RequestOutput` is known to be consistent. Each request has a `RequestStream` holding at most
one pending delta: when its consumer is slow, later deltas merge into it, so a slow client never stalls
the batch and its memory is bounded by the request's own output.

A step that raises fails every request in flight with an error and the engine frees them; if the engine
cannot even do that, it is marked dead (`ready` turns False) and further requests are refused.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from streamd.engine.chat_template import chat_template_ids
from streamd.engine.outputs import RequestOutput
from streamd.engine.request_stream import CompletionDelta, RequestDelta, RequestStream, StreamObserver
from streamd.engine.sampling_params import SamplingParams
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


__all__ = ["AsyncEngine", "CompletionDelta", "DuplicateRequestError", "EngineDeadError", "RequestDelta",
           "RequestStream", "StreamObserver"]


@dataclass(slots=True)
class _Tracked:
    """Engine-thread bookkeeping: how much of each choice was already handed out."""

    num_prompt_tokens: int = 0
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Batch:
    """Everything one engine iteration hands to the loop, in one call_soon_threadsafe."""

    accepted: list[tuple[str, int]] = field(default_factory=list)  # (request_id, num_prompt_tokens)
    rejected: list[tuple[str, BaseException]] = field(default_factory=list)
    deltas: list[RequestDelta] = field(default_factory=list)
    calls: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = field(default_factory=list)
    stats: dict[str, int | float] | None = None
    dead: str | None = None

    def __bool__(self) -> bool:
        return bool(self.accepted or self.rejected or self.deltas or self.calls or self.stats or self.dead)


class AsyncEngine:
    """The asyncio face of an `LLMEngine`. Call `start()` from the event loop that will consume it."""

    def __init__(self, engine: LLMEngine, observer: StreamObserver | None = None) -> None:
        self.engine = engine
        engine.stream_outputs = True  # every step's progress is streamed to the clients
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self.observer = observer
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._admissions: dict[str, asyncio.Future[int]] = {}
        self._calls: set[asyncio.Future[Any]] = set()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._aborting: set[str] = set()  # engine thread only: aborted, final delta not handed out yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stats: dict[str, int | float] = {}
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

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """The model's chat template (never one from a request), on the event loop's tokenizer."""
        return chat_template_ids(self._tokenizer, messages)

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
    def num_waiting(self) -> int:
        """Requests not yet running: the last stats snapshot plus adds the thread has not taken yet."""
        return int(self._stats.get("num_waiting", 0)) + len(self._admissions)

    def stats(self) -> dict[str, int | float]:
        """The snapshot taken after the latest step (exact once idle)."""
        return dict(self._stats)

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
        for stream in list(self._streams.values()):
            stream.cancel()
        self._commands.put(("stop",))
        thread, self._thread = self._thread, None
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    async def add_request(self, request_id: str, prompt: str | None, params: SamplingParams, *,
                          prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Admits a request and returns its stream; raises the engine's RequestError/ValueError if refused."""
        if not self.ready:
            raise EngineDeadError(self._dead or "the engine is not running")
        if request_id in self._streams:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, time.monotonic())
        admitted: asyncio.Future[int] = loop.create_future()
        self._streams[request_id] = stream
        self._admissions[request_id] = admitted
        self._commands.put(("add", request_id, prompt, params, prompt_token_ids, stream.arrival))
        try:
            await asyncio.shield(admitted)
        except asyncio.CancelledError:
            stream.cancel()  # admitted or not, the engine will let go of it
            raise
        return stream

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps (exact stats, test references)."""
        if not self.ready:
            raise EngineDeadError(self._dead or "the engine is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)
        self._commands.put(("call", fn, future))
        return await future

    async def wait_idle(self, timeout: float = 60.0) -> dict[str, int | float]:
        """Waits until no request is in flight (the engine's own view); returns its exact stats then."""
        async with asyncio.timeout(timeout):
            while True:
                # A call runs at the start of an engine iteration, so while the engine is busy each
                # round trip waits for one step: this polls at the step rate, never faster.
                busy, stats = await self.call(lambda e: (e.has_unfinished_requests(), e.stats()))
                if not busy and not self._streams:
                    return stats

    def _abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def _deliver(self, batch: _Batch) -> None:
        """Loop side of the one call per iteration."""
        now = time.monotonic()
        for request_id, _ in batch.accepted:
            future = self._admissions.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(0)
        for request_id, exc in batch.rejected:
            self._streams.pop(request_id, None)
            future = self._admissions.pop(request_id, None)
            if future is not None and not future.done():
                future.set_exception(exc)
        for delta in batch.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                continue
            self._observe(stream, delta, now)
            stream._put(delta)
            if delta.finished:
                del self._streams[delta.request_id]
        for future, result, exc in batch.calls:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(result)
        if batch.stats is not None:
            self._stats = batch.stats
        if batch.dead is not None:
            self._mark_dead(batch.dead)

    def _observe(self, stream: RequestStream, delta: RequestDelta, now: float) -> None:
        count = sum(len(c.token_ids) for c in delta.outputs)
        observer = self.observer
        if count:
            if stream.first_token_time is None:
                stream.first_token_time = now
                if observer is not None:
                    observer.observe_first_token(now - stream.arrival)
                count -= 1
            if count and observer is not None and stream.last_token_time is not None:
                observer.observe_inter_token((now - stream.last_token_time) / count, count)
            stream.last_token_time = now
        if delta.queue_time is not None:
            stream.queue_time = delta.queue_time
        if delta.finished and observer is not None and delta.error is None:
            # Without the engine's scheduling time, the wait for the first token bounds the queue time.
            queue_s = stream.queue_time
            if queue_s is None and stream.first_token_time is not None:
                queue_s = stream.first_token_time - stream.arrival
            observer.observe_finished(now - stream.arrival, queue_s)

    def _mark_dead(self, reason: str) -> None:
        self._dead = reason
        for request_id, future in list(self._admissions.items()):
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        for request_id, stream in list(self._streams.items()):
            stream._put(RequestDelta(request_id, 0, [], finished=True, error=reason))
        for future in list(self._calls):
            if not future.done():
                future.set_exception(EngineDeadError(reason))
        self._admissions.clear()
        self._streams.clear()

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        failures = 0
        try:
            while True:
                batch = _Batch()
                force_step = self._take_commands(batch, block=not engine.has_unfinished_requests())
                if force_step is None:
                    return
                if force_step or engine.has_unfinished_requests():
                    failures = self._step(batch, failures)
                    if failures >= MAX_CONSECUTIVE_STEP_FAILURES:
                        batch.dead = "the engine failed repeatedly and stopped"
                if batch:
                    self._publish(batch)
                if batch.dead is not None:
                    return
        except BaseException as exc:  # the thread must never die silently
            logger.exception("engine_thread_crashed")
            self._publish(_Batch(dead=f"engine thread crashed: {exc!r}"))

    def _take_commands(self, batch: _Batch, block: bool) -> bool | None:
        """Runs queued commands; returns whether a step is needed regardless, or None to stop."""
        force_step = False
        command = self._commands.get() if block else self._get_nowait()
        while command is not None:
            kind = command[0]
            if kind == "stop":
                self._stop(batch)
                return None
            if kind == "add":
                self._do_add(batch, *command[1:])
            elif kind == "abort":
                force_step |= self._do_abort(command[1])
            elif kind == "call":
                _, fn, future = command
                try:
                    batch.calls.append((future, fn(self.engine), None))
                except Exception as exc:
                    batch.calls.append((future, None, exc))
                batch.stats = self.engine.stats()
            command = self._get_nowait()
        return force_step

    def _get_nowait(self) -> tuple[Any, ...] | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _do_add(self, batch: _Batch, request_id: str, prompt: str | None, params: SamplingParams,
                prompt_token_ids: list[int] | None, arrival: float) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, prompt_token_ids=prompt_token_ids,
                                    arrival_time=arrival)
        except Exception as exc:
            batch.rejected.append((request_id, exc))
            return
        num_prompt = len(prompt_token_ids) if prompt_token_ids is not None else 0
        self._tracked[request_id] = _Tracked(num_prompt_tokens=num_prompt)
        batch.accepted.append((request_id, num_prompt))

    def _do_abort(self, request_id: str) -> bool:
        if request_id not in self._tracked or request_id in self._aborting:
            return False
        self._aborting.add(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort_failed", request_id=request_id)
        return True

    def _step(self, batch: _Batch, failures: int) -> int:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            logger.exception("engine_step_failed", in_flight=len(self._tracked))
            batch.deltas.extend(self._fail_all(f"engine step failed: {exc!r}"))
            return failures + 1
        self.steps += 1
        seen: set[str] = set()
        for output in outputs:
            delta = self._cut(output)
            if delta is not None:
                seen.add(output.request_id)
                batch.deltas.append(delta)
        # An aborted request the engine finished without reporting still needs its last delta.
        for request_id in self._aborting - seen:
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None:
                batch.deltas.append(RequestDelta(request_id, tracked.num_prompt_tokens,
                                                 [CompletionDelta(0, "", [], "abort")], finished=True))
        self._aborting.clear()
        batch.stats = self.engine.stats()
        return 0

    def _cut(self, output: RequestOutput) -> RequestDelta | None:
        """The part of a cumulative output not handed out yet."""
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return None
        tracked.num_prompt_tokens = len(output.prompt_token_ids)
        choices = []
        for out in output.outputs:
            text_from = tracked.sent_text.get(out.index, 0)
            tokens_from = tracked.sent_tokens.get(out.index, 0)
            if len(out.token_ids) == tokens_from and len(out.text) == text_from and not out.finished:
                continue
            logprobs = out.logprobs[tokens_from:] if out.logprobs is not None else None
            choices.append(CompletionDelta(out.index, out.text[text_from:], out.token_ids[tokens_from:],
                                           out.finish_reason, out.stop_reason, logprobs, len(out.token_ids)))
            tracked.sent_text[out.index] = len(out.text)
            tracked.sent_tokens[out.index] = len(out.token_ids)
        finished = output.finished or output.error is not None
        if finished:
            del self._tracked[output.request_id]
        if not choices and not finished:
            return None
        return RequestDelta(output.request_id, tracked.num_prompt_tokens, choices, finished, output.error,
                            output.num_cached_tokens, _queue_time(output.metrics))

    def _fail_all(self, message: str) -> list[RequestDelta]:
        """Fails every tracked request; the engine frees them (`abort_all`, or one abort each)."""
        deltas: list[RequestDelta] = []
        try:
            outputs = self.engine.abort_all(message)
        except Exception:
            logger.exception("abort_all_failed")
            outputs = []
        for output in outputs:
            output.error = output.error or message
            delta = self._cut(output)
            if delta is not None:
                deltas.append(delta)
        for request_id, tracked in self._tracked.items():  # anything abort_all did not report
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort_failed", request_id=request_id)
            deltas.append(RequestDelta(request_id, tracked.num_prompt_tokens, [], finished=True, error=message))
        self._tracked.clear()
        self._aborting.clear()
        return deltas

    def _stop(self, batch: _Batch) -> None:
        for request_id in list(self._tracked):
            self._do_abort(request_id)
        while self._tracked and self.engine.has_unfinished_requests():
            if self._step(batch, 0):
                break
        batch.dead = "the engine was shut down"
        self._publish(batch)

    def _publish(self, batch: _Batch) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop closed between the check and the call
            pass


def _queue_time(metrics: dict[str, float] | None) -> float | None:
    if not metrics or metrics.get("first_scheduled_time", -1.0) < 0 or "arrival_time" not in metrics:
        return None  # never scheduled (cancelled while waiting): no queue time to report
    return max(0.0, metrics["first_scheduled_time"] - metrics["arrival_time"])
