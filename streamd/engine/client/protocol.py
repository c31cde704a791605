"""`EngineClient`: what the server needs of an engine, whatever side of a thread or process it runs on.

The server types against this protocol and never names an implementation: `AsyncEngine` (the engine loop
on a thread of this process, async_engine.py) and `ProcessEngine` (the engine loop in a child process,
engine_process.py) both satisfy it, neither a kind of the other. Everything here is called on the event
loop the client was started on.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from streamd.engine.client.request_stream import DeltaSink, RequestStream
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats


class EngineDeadError(RuntimeError):
    """The engine loop stopped or could not recover from a failed step."""

    code = "engine_unavailable"


class DuplicateRequestError(ValueError):
    code = "duplicate_id"


@runtime_checkable
class EngineClient(Protocol):
    """The asyncio face of an engine. `start()` on the event loop that will consume it, `shutdown()` last."""

    @property
    def model_name(self) -> str: ...

    @property
    def tokenizer(self) -> Any:
        """A tokenizer the event loop may use (never the one the engine decodes with)."""
        ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def ready(self) -> bool:
        """Started, its engine loop alive and not dead."""
        ...

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def num_waiting(self) -> int:
        """Requests not yet running, submissions the engine has not taken yet included."""
        ...

    @property
    def thread_id(self) -> int | None:
        """The native id of the thread that steps the engine (benchmarks read its CPU time)."""
        ...

    @property
    def process_id(self) -> int | None:
        """The id of the process that steps the engine."""
        ...

    def stats(self) -> EngineStats:
        """The snapshot published after the latest step (exact once idle)."""
        ...

    def start(self) -> None: ...

    async def shutdown(self) -> None:
        """Aborts everything in flight and stops the engine loop."""
        ...

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Raises GrammarError naming what is wrong with the request's schema, before it is submitted
        (or does nothing, where the engine compiles it at admission)."""
        ...

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
        ...

    async def add_request(
        self, request_id: str, prompt: str | None, params: SamplingParams, *, prompt_token_ids: list[int] | None = None
    ) -> RequestStream:
        """`submit` to a new `RequestStream`, returned."""
        ...

    def abort(self, request_id: str) -> None:
        """Asks the engine to abort a request; its sink then gets a final delta (unless already done)."""
        ...

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Stops (True) or restarts (False) scheduling a request whose consumer fell behind / caught up."""
        ...
