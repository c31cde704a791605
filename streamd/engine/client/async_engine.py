"""AsyncEngine: the `EngineClient` whose engine loop runs on a dedicated thread of this process.

The thread runs an `EngineLoop` (loop.py) over the `LLMEngine`; nothing else touches the engine. The
event loop puts typed commands on the loop's queue, and the loop publishes each iteration's `StepBatch`
with one `loop.call_soon_threadsafe`, which hands it to this client's `Deliveries` (admissions, each
request's sink, stats). Deltas are produced once, by the engine's output processor; this module only moves
them across the thread boundary.

Only here, with the engine in this process, can a function run on the engine thread between steps
(`call`, `wait_idle`: exact stats, test references); the server never needs that.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamd.engine.client.deliveries import Deliveries
from streamd.engine.client.loop import (
    AbortRequest,
    AddRequest,
    CallEngine,
    EngineLoop,
    PauseRequest,
    StepBatch,
    StopEngine,
)
from streamd.engine.client.protocol import DuplicateRequestError, EngineDeadError
from streamd.engine.client.request_stream import DeltaSink, RequestStream
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats

if TYPE_CHECKING:
    from streamd.engine.llm_engine import LLMEngine

__all__ = ["AsyncEngine", "DuplicateRequestError", "EngineDeadError"]


class AsyncEngine:
    """The engine loop on a thread, for asyncio. Call `start()` from the event loop that will consume it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self.engine_loop = EngineLoop(engine, self._publish)
        self.deliveries = Deliveries(engine.stats())
        self._calls: set[asyncio.Future[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def tokenizer(self) -> Any:
        """The event loop's own copy of the engine's tokenizer: a Hugging Face fast tokenizer must not be
        used from two threads at once, and the engine thread decodes with the original."""
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.deliveries.dead is None

    @property
    def dead_reason(self) -> str | None:
        return self.deliveries.dead

    @property
    def num_waiting(self) -> int:
        return self.deliveries.num_waiting

    @property
    def thread_id(self) -> int | None:
        return self._thread.native_id if self._thread is not None else None

    @property
    def process_id(self) -> int | None:
        return os.getpid()

    @property
    def steps(self) -> int:
        """Engine iterations that ran a step (tests use it to see that idle means idle)."""
        return self.engine_loop.steps

    def stats(self) -> EngineStats:
        return self.deliveries.stats

    def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self.deliveries.stats = self.engine.stats()
        self._thread = threading.Thread(target=self.engine_loop.run, name="streamd-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        for request_id in self.deliveries.in_flight():
            self.abort(request_id)
        self.engine_loop.put(StopEngine())  # after the aborts: their final deltas come first
        thread, self._thread = self._thread, None
        await asyncio.get_running_loop().run_in_executor(None, thread.join)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compiles (and caches) the request's grammar on a worker thread, so a slow schema never blocks
        the event loop; raises GrammarError naming what is wrong, before the request is submitted."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.compile_grammar, params)

    async def add_request(
        self, request_id: str, prompt: str | None, params: SamplingParams, *, prompt_token_ids: list[int] | None = None
    ) -> RequestStream:
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
        self._check_ready()
        add = AddRequest(request_id, prompt, params, prompt_token_ids, time.monotonic())
        await self.deliveries.admit(request_id, sink, lambda: self.engine_loop.put(add), self.abort)

    def abort(self, request_id: str) -> None:
        self.engine_loop.put(AbortRequest(request_id))

    def set_paused(self, request_id: str, paused: bool) -> None:
        self.engine_loop.put(PauseRequest(request_id, paused))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs `fn(engine)` on the engine thread between steps; returns its result (or raises its error)."""
        self._check_ready()
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)
        self.engine_loop.put(CallEngine(fn, future))
        return await future

    async def wait_idle(self, timeout: float = 60.0) -> EngineStats:
        """Waits until no request is in flight (the engine's own view); returns its exact stats then."""
        async with asyncio.timeout(timeout):
            while True:
                # A call runs at the start of an engine iteration, so while the engine is busy each
                # round trip waits for one step: this polls at the step rate, never faster.
                busy, stats = await self.call(lambda e: (e.has_unfinished_requests(), e.stats()))
                if not busy and not self.deliveries.sinks:
                    return stats

    def _check_ready(self) -> None:
        if not self.ready:
            raise EngineDeadError(self.deliveries.dead or "the engine is not running")

    # ---- the engine thread's publish, and its delivery on the loop --------------------------------
    def _publish(self, batch: StepBatch) -> None:
        """Engine thread: one hand-off per iteration."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # the loop closed between the check and the call
            pass

    def _deliver(self, batch: StepBatch) -> None:
        for call in batch.calls:
            if not call.future.done():
                if call.error is not None:
                    call.future.set_exception(call.error)
                else:
                    call.future.set_result(call.value)
        self.deliveries.deliver(batch)
        if batch.dead is not None:
            for future in list(self._calls):
                if not future.done():
                    future.set_exception(EngineDeadError(batch.dead))
