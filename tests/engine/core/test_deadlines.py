"""Request deadlines in the engine (issue 12): `timeout_s` ends a request with finish_reason "timeout" and
its output so far (a prefix of what it would have produced), `queue_timeout_s` ends a request never
scheduled in time with no output, and a paused request still times out (the engine's idle wait wakes at
the deadline). Every test ends with the pool whole (root conftest)."""

from __future__ import annotations

import time

from streamd import LLM, SamplingParams
from tests.helpers import fold_deltas, run_to_completion, step_until_idle

LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}


def test_timeout_keeps_the_output_so_far(smol_llm: LLM) -> None:
    (out,) = run_to_completion(smol_llm.engine, ["Once upon a time"], SamplingParams(**LONG, timeout_s=0.5))
    partial = out.outputs[0]
    assert partial.finish_reason == "timeout" and 0 < len(partial.token_ids) < 2000
    (full,) = run_to_completion(smol_llm.engine, ["Once upon a time"],
                                SamplingParams(**{**LONG, "max_tokens": len(partial.token_ids)}))
    assert full.outputs[0].token_ids == partial.token_ids and full.outputs[0].text == partial.text


def test_queue_timeout_ends_a_request_never_scheduled(smol_llm: LLM) -> None:
    engine = smol_llm.engine
    hold, engine.scheduler.max_num_seqs = engine.scheduler.max_num_seqs, 1
    try:
        engine.add_request("busy", "Hi", SamplingParams(**LONG))
        engine.add_request("late", "Hi", SamplingParams(max_tokens=4, queue_timeout_s=0.2))
        builders: dict = {}
        while "late" not in builders or not builders["late"].finished:
            fold_deltas(engine.step(), builders)
        engine.abort("busy")
        step_until_idle(engine, builders)
    finally:
        engine.scheduler.max_num_seqs = hold
    late = builders["late"].build()
    assert late.outputs[0].finish_reason == "timeout" and late.outputs[0].token_ids == []


def test_paused_request_times_out_and_the_idle_engine_wakes_for_it(smol_llm: LLM) -> None:
    engine = smol_llm.engine
    engine.add_request("p", "Hi", SamplingParams(**LONG, timeout_s=0.5))
    builders: dict = {}
    fold_deltas(engine.step(), builders)
    engine.set_paused("p", True)
    fold_deltas(engine.step(), builders)  # reads back the step in flight; schedules nothing
    assert not engine.has_runnable_work() and engine.has_unfinished_requests()
    assert engine.next_deadline is not None
    time.sleep(max(0.0, engine.next_deadline - time.monotonic()))  # what AsyncEngine's idle wait does
    out = step_until_idle(engine, builders)["p"]
    assert out.outputs[0].finish_reason == "timeout" and engine.stats().scheduler.num_paused == 0
    assert engine.next_deadline is None


async def test_pause_and_deadlines_cross_into_an_engine_process(smol_llm: LLM) -> None:
    """`ProcessEngine`: the pause command reaches the child, whose idle wait still wakes at the deadline."""
    from streamd.engine.client.engine_process import ProcessEngine
    from streamd.engine.llm_engine import LLMEngine

    engine = ProcessEngine(LLMEngine.from_config, smol_llm.config, outputs="network",
                           batches_ahead=smol_llm.config.engine.batches_ahead)
    engine.start()
    try:
        stream = await engine.add_request("p", "Once upon a time", SamplingParams(**LONG, timeout_s=1.5))
        first = await anext(stream)
        engine.set_paused("p", True)
        deltas = [first] + [delta async for delta in stream]
        assert deltas[-1].finished and deltas[-1].outputs[-1].finish_reason == "timeout"
        after_pause = sum(len(c.token_ids) for d in deltas[1:] for c in d.outputs)
        assert after_pause <= 5  # at most the steps already in flight when the pause arrived
        assert engine.stats().pool_whole and engine.stats().scheduler.num_paused == 0
    finally:
        await engine.shutdown()
