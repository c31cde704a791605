"""`EngineLoop` alone, over a scripted engine and a plain list as its `publish` (no thread, no event loop,
no socket): commands run in order before each step, their admissions are published before the step and its
deltas after (one batch each), `StopEngine` steps the
aborted requests to their final deltas, and repeated step failures fail the requests, then end the loop as
dead."""

from __future__ import annotations

from streamd.engine.client.loop import (
    MAX_CONSECUTIVE_STEP_FAILURES,
    AbortRequest,
    AddRequest,
    EngineLoop,
    FinishChoice,
    PauseRequest,
    StepBatch,
    StopEngine,
)
from streamd.engine.errors import RequestError
from streamd.engine.outputs import CompletionDelta, RequestDelta
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.stats import EngineStats, KVCacheStats, SchedulerStats


class _ScriptedEngine:
    """Each request takes `tokens` steps; an abort ends it at the next step. `failures` steps raise."""

    def __init__(self, tokens: int = 2, failures: int = 0) -> None:
        self.tokens, self.failures = tokens, failures
        self.left: dict[str, int] = {}
        self.aborted: list[str] = []
        self.log: list[tuple[str, ...]] = []
        self.next_deadline = None
        self.closed = False

    def add_request(self, request_id: str, prompt: str | None, params: SamplingParams, **_: object) -> list[int]:
        if prompt == "refuse":
            raise RequestError("refused")
        self.left[request_id] = self.tokens
        return [1]

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def set_paused(self, request_id: str, paused: bool) -> None:
        self.log.append(("pause", request_id, str(paused)))

    def finish_choice(self, request_id: str, index: int) -> None:
        self.log.append(("finish", request_id, str(index)))

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def has_runnable_work(self) -> bool:
        return bool(self.left)

    def step(self) -> list[RequestDelta]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("injected")
        deltas = []
        for request_id in list(self.left):
            self.left[request_id] -= 1
            ended = request_id in self.aborted or not self.left[request_id]
            reason = "abort" if request_id in self.aborted else "length" if ended else None
            deltas.append(RequestDelta(request_id, 1, [CompletionDelta(0, "x", [7], reason)], finished=ended))
            if ended:
                del self.left[request_id]
        return deltas

    def abort_all(self, error: str) -> list[RequestDelta]:
        ended, self.left = list(self.left), {}
        return [RequestDelta(r, 1, [], finished=True, error=error) for r in ended]

    def stats(self) -> EngineStats:
        return EngineStats(KVCacheStats(*[0] * 11), SchedulerStats(0, 0, 0, 0, 0, 0), len(self.left), 0)

    def close(self) -> None:  # what StopEngine calls last (the prefix cache's tiers flush there)
        self.closed = True


def _run(engine: _ScriptedEngine, *commands: object) -> list[StepBatch]:
    published: list[StepBatch] = []
    loop = EngineLoop(engine, published.append)  # type: ignore[arg-type]
    for command in commands:
        loop.put(command)  # type: ignore[arg-type]
    loop.run()  # on this thread: the loop needs none of its own
    return published


def test_commands_then_one_publish_per_iteration_and_stop_finishes_the_aborted() -> None:
    engine = _ScriptedEngine(tokens=50)
    params = SamplingParams(max_tokens=50)
    batches = _run(engine, AddRequest("a", "p", params, None, 0.0), AddRequest("bad", "refuse", params, None, 0.0),
                   PauseRequest("a", True), FinishChoice("a", 0), AbortRequest("a"), StopEngine())
    assert engine.log == [("pause", "a", "True"), ("finish", "a", "0")] and engine.aborted == ["a"]
    (batch,) = batches  # every command ran in one iteration; StopEngine stepped "a" to its end
    assert batch.accepted == ["a"] and [r.request_id for r in batch.rejected] == ["bad"]
    assert [(d.request_id, d.finished, d.outputs[0].finish_reason) for d in batch.deltas] == [("a", True, "abort")]
    assert batch.dead == "the engine was shut down" and batch.stats is not None
    assert engine.closed  # after the last step: the prefix cache's tiers get the device's cached blocks


def test_admissions_are_published_before_the_step_that_follows_them() -> None:
    """A long step (a long prefill) must not hold a request's admission, and so its response's head."""
    engine = _ScriptedEngine(tokens=2)
    published: list[StepBatch] = []
    loop = EngineLoop(engine, published.append)  # type: ignore[arg-type]
    loop.put(AddRequest("a", "p", SamplingParams(max_tokens=2), None, 0.0))
    loop._iterate()
    assert [(b.accepted, [d.request_id for d in b.deltas]) for b in published] == [(["a"], []), ([], ["a"])]
    loop._iterate()  # no command: the step's batch alone
    assert len(published) == 3 and published[2].deltas[0].finished


def test_repeated_step_failures_fail_the_requests_then_the_engine() -> None:
    engine = _ScriptedEngine(tokens=50, failures=MAX_CONSECUTIVE_STEP_FAILURES)
    params = SamplingParams(max_tokens=50)
    adds = [AddRequest(f"r{i}", "p", params, None, 0.0) for i in range(MAX_CONSECUTIVE_STEP_FAILURES)]
    published: list[StepBatch] = []
    loop = EngineLoop(engine, published.append)  # type: ignore[arg-type]
    for add in adds:  # one request per failing step: each failure fails what is in flight
        loop.put(add)
        loop._iterate()
    steps = [b for b in published if b.deltas or b.dead]  # (each admission went out before its step)
    assert [[(d.request_id, "injected" in (d.error or "")) for d in b.deltas] for b in steps] == [
        [(a.request_id, True)] for a in adds]
    assert [b.dead for b in steps] == [None] * (MAX_CONSECUTIVE_STEP_FAILURES - 1) + [
        "the engine failed repeatedly and stopped"]
    assert loop.steps == 0
