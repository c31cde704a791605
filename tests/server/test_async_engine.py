"""AsyncEngine on the real engine: one loop hand-off per step, merged deltas for slow consumers, an idle
thread that sleeps, failed steps that fail requests (not the process), cancellation that aborts."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from streamd import SamplingParams
from streamd.engine.client.async_engine import AsyncEngine

GREEDY = dict(temperature=0.0, ignore_eos=True)


async def consume(stream) -> list:
    return [delta async for delta in stream]


async def test_one_call_soon_threadsafe_per_step(async_engine: AsyncEngine) -> None:
    class CountingLoop:
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop, self.calls = loop, 0

        def call_soon_threadsafe(self, *args: Any) -> Any:
            self.calls += 1
            return self.loop.call_soon_threadsafe(*args)

        def is_closed(self) -> bool:
            return self.loop.is_closed()

    real = async_engine._loop
    counting = CountingLoop(real)
    async_engine._loop = counting  # type: ignore[assignment]
    try:
        steps = async_engine.steps
        streams = [await async_engine.add_request(f"count-{i}", f"Number {i}:", SamplingParams(max_tokens=6, **GREEDY))
                   for i in range(3)]
        await asyncio.gather(*(consume(s) for s in streams))
        steps = async_engine.steps - steps
    finally:
        async_engine._loop = real
    assert steps >= 6
    # One per step, and one per admission (published before its step, so a response's head need not wait for it).
    assert counting.calls <= steps + len(streams)


async def test_slow_consumer_gets_merged_deltas(async_engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=8, **GREEDY)
    slow = await async_engine.add_request("slow", "The alphabet: A, B,", params)
    fast = await async_engine.add_request("fast", "The alphabet: A, B,", params)
    fast_deltas = await consume(fast)  # both finish in the same step; `slow` has read nothing yet
    slow_deltas = await consume(slow)
    assert len(fast_deltas) >= 2
    assert len(slow_deltas) == 1 and slow_deltas[0].finished
    merged = slow_deltas[0].outputs[0]
    assert merged.token_ids == [t for d in fast_deltas for c in d.outputs for t in c.token_ids]
    assert merged.text == "".join(c.text for d in fast_deltas for c in d.outputs)
    assert merged.num_tokens == 8 and merged.finish_reason == "length"


async def test_idle_engine_thread_sleeps(async_engine: AsyncEngine) -> None:
    await async_engine.wait_idle()
    clock = time.pthread_getcpuclockid(async_engine._thread.ident)  # type: ignore[union-attr]
    before, steps = time.clock_gettime(clock), async_engine.steps
    await asyncio.sleep(0.5)  # a measurement window, not synchronisation
    assert time.clock_gettime(clock) - before < 0.05
    assert async_engine.steps == steps


async def test_cancelling_the_consumer_aborts_the_request(async_engine: AsyncEngine) -> None:
    stream = await async_engine.add_request("cancel-me", "Go:", SamplingParams(max_tokens=2000, **GREEDY))
    first = asyncio.Event()

    async def reader() -> None:
        async for _ in stream:
            first.set()

    task = asyncio.create_task(reader())
    await first.wait()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # one consumer at a time: the cancelled reader lets go of the stream first
    rest = await consume(stream)  # the engine's final delta: an abort, long before 2000 tokens
    stats = await async_engine.wait_idle()
    assert stats.kv.blocks_free == stats.kv.blocks_total
    assert stream.finished and rest[-1].finished
    assert rest[-1].outputs[-1].finish_reason == "abort"
    assert rest[-1].outputs[-1].num_tokens < 2000


async def test_failed_step_fails_requests_and_engine_recovers(async_engine: AsyncEngine) -> None:
    def break_next_step(engine: Any) -> None:
        real_step = engine.step

        def failing_step() -> Any:
            engine.step = real_step  # fail once
            raise RuntimeError("injected failure")

        engine.step = failing_step

    stream = await async_engine.add_request("victim", "Hello", SamplingParams(max_tokens=50, **GREEDY))
    await async_engine.call(break_next_step)
    deltas = await consume(stream)
    assert deltas[-1].finished and "injected failure" in (deltas[-1].error or "")
    assert async_engine.ready
    again = await consume(await async_engine.add_request("after", "Hello", SamplingParams(max_tokens=3, **GREEDY)))
    assert again[-1].finished and again[-1].error is None
    assert sum(len(c.token_ids) for d in again for c in d.outputs) == 3
    await async_engine.call(lambda e: vars(e).pop("step", None))  # the instance attribute is gone again


async def test_refused_request_raises_and_duplicate_ids(async_engine: AsyncEngine) -> None:
    import pytest

    from streamd.engine.errors import ContextLengthError

    with pytest.raises(ContextLengthError):
        await async_engine.add_request("too-long", None, SamplingParams(max_tokens=10),
                                       prompt_token_ids=[5] * async_engine.max_model_len)
    stream = await async_engine.add_request("dup", "Hi", SamplingParams(max_tokens=30, **GREEDY))
    from streamd.engine.client.async_engine import DuplicateRequestError

    with pytest.raises(DuplicateRequestError):
        await async_engine.add_request("dup", "Hi", SamplingParams(max_tokens=2))
    stream.cancel()
    deltas = await consume(stream)
    assert deltas[-1].outputs[-1].finish_reason == "abort"




def test_offline_work_between_server_tests(smol_llm) -> None:
    # What a tests/engine test does: it steps the session's engine offline, behind the AsyncEngine's loop
    # (idle between tests), whose stats stay those of its last published batch.
    outputs = smol_llm.generate(["Outside the loop"], SamplingParams(max_tokens=7, **GREEDY))
    assert len(outputs[0].outputs[0].token_ids) == 7


async def test_a_test_starts_with_the_engines_own_stats(async_engine: AsyncEngine, smol_llm) -> None:
    # (runs after the one above: same file, same worker) the server tests' fixture waits idle before each test,
    # which refreshes stats(); without it a metrics scrape or the stats feed counted an earlier test's offline
    # tokens as the test's own (two CI failures: 16 and 248 tokens too many)
    assert async_engine.stats().generated_tokens == smol_llm.engine.stats().generated_tokens
