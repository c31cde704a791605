"""The engine in its own process (`ProcessEngine`), with deltas made in the engine
process or in this one: the default model in a child process gives the same tokens and text as the offline
engine (stop strings included), an abort ends its request with "abort", the pool is whole afterwards, and
shutdown ends the child."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading

import pytest

from streamd.engine.client.engine_child import BatchSender, CommandRouter
from streamd.engine.client.engine_process import ProcessEngine
from streamd.engine.client.loop import STEP_BATCH_WIRE, AbortRequest, AddRequest, FinishChoice, StepBatch, StopEngine
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.outputs import RequestOutputBuilder
from streamd.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


async def _fold(engine: ProcessEngine, request_id: str, prompt: str, params: SamplingParams, *,
                as_text: bool = False) -> RequestOutputBuilder:
    if as_text:  # tokenized by the engine (outputs="engine") or by ProcessEngine (outputs="network")
        stream = await engine.add_request(request_id, prompt, params)
    else:
        ids = engine.tokenizer(prompt).input_ids
        stream = await engine.add_request(request_id, None, params, prompt_token_ids=list(ids))
    builder = RequestOutputBuilder(request_id, prompt, [])
    async for delta in stream:
        builder.add(delta)
    return builder


@pytest.mark.parametrize(("outputs", "batches_ahead"), [("engine", 1), ("network", 8)])
async def test_process_engine_matches_the_offline_engine(smol_llm, outputs: str, batches_ahead: int) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = smol_llm.generate(PROMPTS, params)
    # A stop string taken from the reference's own text, so that it certainly occurs mid-output.
    stop_at = expected[1].outputs[0].text[6:9]
    stopping = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_at])
    (expected_stop,) = smol_llm.generate(PROMPTS[1:2], stopping)
    assert expected_stop.outputs[0].finish_reason == "stop"
    engine = ProcessEngine(LLMEngine.from_config, smol_llm.config, outputs=outputs, batches_ahead=batches_ahead)
    engine.start()
    try:
        assert engine.model_name == smol_llm.engine.model_name and engine.ready
        assert engine.max_model_len == smol_llm.engine.max_model_len
        assert engine.thread_id is not None and engine.thread_id != threading.get_native_id()
        builders = await asyncio.gather(*(_fold(engine, f"p{i}", p, params) for i, p in enumerate(PROMPTS)),
                                        _fold(engine, "stop", PROMPTS[1], stopping, as_text=True))
        for builder, reference in zip(builders, [*expected, expected_stop]):
            (got,) = builder.build().outputs
            want = reference.outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
                want.token_ids, want.text, want.finish_reason, want.stop_reason)
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = await engine.add_request("long", PROMPTS[0], long)
        last = await anext(stream)
        engine.abort("long")
        async for last in stream:
            pass
        assert last.finished and last.outputs[-1].finish_reason == "abort"
        # (outputs="network": the stop string's FinishChoice went to the engine before "long" was added, and
        # commands run in order, so the stats that came with the abort already count it as finished.)
        assert engine.stats().pool_whole and engine.stats().num_requests == 0
    finally:
        await engine.shutdown()
    assert not engine.process.is_alive()


@pytest.mark.parametrize("batches_ahead", [1, 3])
def test_the_engine_publishes_at_most_batches_ahead_undelivered_batches(batches_ahead: int) -> None:
    """The engine process's side of the credit: `batches_ahead` batches go out with no `Delivered` back; the
    next waits for a credit (what caps how many steps merge while the network side is behind)."""
    ours, theirs = socket.socketpair()
    sender = BatchSender(theirs, batches_ahead, None)
    for _ in range(batches_ahead):
        sender(StepBatch())
    assert sender.credits.acquire(blocking=False) is False  # the next publish would wait here
    published = threading.Thread(target=sender, args=(StepBatch(),))
    published.start()
    sender.credits.release()  # one batch delivered: one more may go
    published.join(timeout=30)
    assert not published.is_alive()
    received = ours.recv(1 << 20)
    count = 0
    while received:
        size = int.from_bytes(received[:4], "little")
        assert STEP_BATCH_WIRE.decode(pickle.loads(received[4:4 + size])) == StepBatch()  # an empty batch
        received, count = received[4 + size:], count + 1
    assert count == batches_ahead + 1
    ours.close()
    theirs.close()


class _SlowGrammarEngine:
    """compile_grammar blocks until released: a schema that takes long to compile."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.compiling = threading.Event()

    def compile_grammar(self, params: SamplingParams) -> None:
        self.compiling.set()
        assert self.release.wait(30)


def test_a_slow_grammar_delays_only_its_own_request() -> None:
    """While B's grammar compiles on the admission thread, commands for other requests reach the engine at
    once, and B's own later commands wait behind its add (none overtakes it); StopEngine comes last."""
    import queue

    engine, commands = _SlowGrammarEngine(), queue.SimpleQueue()
    router = CommandRouter(engine, commands)
    admitting = threading.Thread(target=router.admit)
    admitting.start()
    threading.Thread(target=router.admit_light, daemon=True).start()
    structured = SamplingParams(max_tokens=4, structured_outputs={"choice": ["yes", "no"]})
    add_b = AddRequest("B", None, structured, [1, 2], 0.0)
    router.route(add_b)
    assert engine.compiling.wait(30)
    router.route(AbortRequest("A"))
    router.route(FinishChoice("A", 0))
    router.route(AbortRequest("B"))
    router.route(StopEngine())
    assert commands.get(timeout=30) == AbortRequest("A")  # not behind B's compile
    assert commands.get(timeout=30) == FinishChoice("A", 0)  # A's stop-string finish, likewise
    assert commands.empty()  # B's abort and StopEngine wait for B's add
    engine.release.set()
    assert [commands.get(timeout=30) for _ in range(3)] == [add_b, AbortRequest("B"), StopEngine()]
    admitting.join(timeout=30)
    assert not admitting.is_alive() and not router.queued
    router.route(AbortRequest("B"))  # B admitted: its commands go straight on again
    assert commands.get_nowait() == AbortRequest("B")


class _SlowHeavyGrammarEngine(_SlowGrammarEngine):
    """Only heavy specs (grammar_budget: not light) block their compile."""

    def compile_grammar(self, params: SamplingParams) -> None:
        spec = params.structured_outputs
        if spec is not None and spec.regex is not None and len(spec.regex) > 4096:
            super().compile_grammar(params)


def test_a_light_grammar_never_waits_behind_a_heavy_one() -> None:
    """The engine process's admission has a lane for light specs: while a heavy one compiles, a trivial
    schema's add reaches the engine at once (issue 35: it waited 65 s); StopEngine still comes last."""
    import queue

    engine, commands = _SlowHeavyGrammarEngine(), queue.SimpleQueue()
    router = CommandRouter(engine, commands)
    lanes = [threading.Thread(target=router.admit), threading.Thread(target=router.admit_light)]
    for lane in lanes:
        lane.start()
    heavy = AddRequest("H", None, SamplingParams(max_tokens=4, structured_outputs={"regex": "a" * 5000}), [1], 0.0)
    light = AddRequest("L", None, SamplingParams(max_tokens=4, structured_outputs={"choice": ["yes", "no"]}), [1], 0.0)
    router.route(heavy)
    assert engine.compiling.wait(30)
    router.route(light)
    router.route(AbortRequest("L"))
    router.route(StopEngine())
    assert [commands.get(timeout=30) for _ in range(2)] == [light, AbortRequest("L")]
    assert commands.empty()  # H's add and StopEngine wait for H's compile
    engine.release.set()
    assert [commands.get(timeout=30) for _ in range(2)] == [heavy, StopEngine()]
    for lane in lanes:
        lane.join(timeout=30)
        assert not lane.is_alive()
    assert not router.queued
