"""ProcessEngine: the `EngineClient` whose engine loop runs in a process of its own, so the network side and
the engine stop sharing one GIL.

The `LLMEngine` runs in a child process (started with `spawn`), driven there by the same `EngineLoop` as on
a thread (engine_child.py). Commands go down one socket pair, pickled; each iteration's `StepBatch` comes
back on the other as one frame of the wire codec (wire.py), read by the event loop when the socket is
readable and handed to this client's `Deliveries`, as the thread client does, so sinks, accounts and frames
are the same. Each delivered batch sends a credit back: the engine runs at most `batches_ahead` batches
ahead of their delivery (`engine.batches_ahead`: engine_child.py says why, benchmarks/NOTES.md
has the measurements that chose the default).

With `outputs="network"` the output processor (detokenizer, stop strings, deltas) runs in this process
(`NetworkOutputs`), as in engines whose front end detokenizes: the child sends each step's `RequestUpdate`s
and they become deltas here; a choice that a stop string ended is finished in the engine by a `FinishChoice`
command, a step or two later (the tokens sampled meanwhile are void to the output processor, as when the
engine finishes it itself).

Not here: running a function on the engine (`AsyncEngine.call`), refusing a bad grammar before submission
(the engine refuses it at admission, naming why) and tensor parallelism.
"""

from __future__ import annotations

import asyncio
import copy
import multiprocessing
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streamd.engine.client import wire
from streamd.engine.client.deliveries import Deliveries
from streamd.engine.client.engine_child import DELIVERED_FRAME, EngineInfo, child_main
from streamd.engine.client.loop import (
    STEP_BATCH_WIRE,
    AbortRequest,
    AddRequest,
    EngineCommand,
    FinishChoice,
    PauseRequest,
    StepBatch,
    StopEngine,
)
from streamd.engine.client.protocol import EngineDeadError
from streamd.engine.client.request_stream import DeltaSink, RequestStream
from streamd.engine.output.output_processor import OutputProcessor
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats

if TYPE_CHECKING:
    from streamd.engine.llm_engine import LLMEngine

OUTPUTS = ("engine", "network")


class NetworkOutputs:
    """The output processor in the network process: requests join it when admitted, and each batch's
    updates become its deltas here."""

    def __init__(self, tokenizer: Any) -> None:
        self.processor = OutputProcessor(tokenizer)
        self.prompts: dict[str, tuple[list[int], SamplingParams, float]] = {}  # submitted, not yet admitted

    def expect(self, add: AddRequest) -> None:
        self.prompts[add.request_id] = (list(add.prompt_token_ids or []), add.params, add.arrival_time)

    def apply(self, batch: StepBatch) -> list[FinishChoice]:
        """Fills the batch's deltas; returns the choices a stop string ended (the engine must finish them)."""
        for request_id in batch.accepted:
            ids, params, arrival = self.prompts.pop(request_id)
            self.processor.add_request(request_id, ids, params, arrival)
        for rejection in batch.rejected:
            self.prompts.pop(rejection.request_id, None)
        processed = self.processor.process(batch.updates)
        batch.deltas = processed.deltas
        return [FinishChoice(hit.request_id, hit.index) for hit in processed.stop_hits]


class ProcessEngine:
    """The engine loop in a child process; `factory(*args)` builds the `LLMEngine` there. `outputs`:
    "engine" (deltas made in the child) or "network" (made here from the child's updates);
    `batches_ahead`: how many step batches the engine may publish before this side has delivered them."""

    def __init__(self, factory: Callable[..., LLMEngine], *args: Any, outputs: str, batches_ahead: int) -> None:
        if outputs not in OUTPUTS:
            raise ValueError(f"outputs must be 'engine' or 'network', not {outputs!r}")
        if batches_ahead < 1:
            raise ValueError(f"batches_ahead must be at least 1, not {batches_ahead}")
        # Two socket pairs: commands (blocking sends; the child's reader thread always drains them) and
        # batches (read by the event loop when readable).
        self._command_sock, their_commands = socket.socketpair()
        self._sock, theirs = socket.socketpair()
        self.process = multiprocessing.get_context("spawn").Process(
            target=child_main,
            args=(factory, args, outputs == "engine", batches_ahead, their_commands, theirs),
            name="streamd-engine",
            daemon=True,
        )
        self.process.start()
        their_commands.close()
        theirs.close()
        self.info: EngineInfo = wire.receive(self._sock)
        self._tokenizer = copy.deepcopy(self.info.tokenizer)
        self.deliveries = Deliveries(self.info.initial_stats)
        self.outputs = NetworkOutputs(self.info.tokenizer) if outputs == "network" else None
        self._frames = wire.FrameReader()
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def model_name(self) -> str:
        return self.info.model_name

    @property
    def tokenizer(self) -> Any:
        """The event loop's copy of the engine's tokenizer (the network output processor decodes with another)."""
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def ready(self) -> bool:
        return self._loop is not None and self.process.is_alive() and self.deliveries.dead is None

    @property
    def dead_reason(self) -> str | None:
        return self.deliveries.dead

    @property
    def num_waiting(self) -> int:
        return self.deliveries.num_waiting

    @property
    def thread_id(self) -> int | None:
        return self.info.thread_id

    @property
    def process_id(self) -> int | None:
        return self.process.pid

    def stats(self) -> EngineStats:
        return self.deliveries.stats

    def start(self) -> None:
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._on_readable)

    async def shutdown(self) -> None:
        if self._loop is None:
            return
        for request_id in self.deliveries.in_flight():
            self.abort(request_id)
        self._send(StopEngine())  # after the aborts: their final deltas come first
        await self._loop.run_in_executor(None, self.process.join, 60)
        self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._loop = None

    async def compile_grammar(self, params: SamplingParams) -> None:
        return None  # the engine process compiles it when it admits the request

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
        if not self.ready:
            raise EngineDeadError(self.deliveries.dead or "the engine is not running")
        if self.outputs is not None and prompt_token_ids is None and isinstance(prompt, str):
            # Tokenized once, here (as LLMEngine tokenizes a text prompt): the child takes these ids and
            # keeps the text, instead of tokenizing it again on the engine's side of the split.
            prompt_token_ids = list(self._tokenizer(prompt).input_ids)
        add = AddRequest(request_id, prompt, params, prompt_token_ids, time.monotonic())
        await self.deliveries.admit(request_id, sink, lambda: self._send_add(add), self.abort)

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    def set_paused(self, request_id: str, paused: bool) -> None:
        self._send(PauseRequest(request_id, paused))

    def _send_add(self, add: AddRequest) -> None:
        if self.outputs is not None:
            self.outputs.expect(add)
        self._send(add)

    def _send(self, command: EngineCommand) -> None:
        """Commands cross pickled (they are few: one or two per request)."""
        try:
            wire.send(self._command_sock, command)
        except OSError:  # the engine process is gone; the batch socket's end marks the engine dead
            pass

    # ---- batches from the engine process ---------------------------------------------------------
    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(wire.READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            assert self._loop is not None
            self._loop.remove_reader(self._sock.fileno())
            if self.deliveries.dead is None:
                self.deliveries.mark_dead("the engine process exited")
            return
        for message in self._frames.feed(data):
            self._deliver(STEP_BATCH_WIRE.decode(message))
            try:
                self._command_sock.sendall(DELIVERED_FRAME)
            except OSError:  # the engine process is gone; the socket's end marks the engine dead
                pass

    def _deliver(self, batch: StepBatch) -> None:
        if self.outputs is not None:
            for finish in self.outputs.apply(batch):
                self._send(finish)
        self.deliveries.deliver(batch)
