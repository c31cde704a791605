"""The engine in its own process (`ProcessEngine`, the issue-9 prototype), with deltas made in the engine
process or in this one: the default model in a child process gives the same tokens and text as the offline
engine (stop strings included), an abort ends its request with "abort", the pool is whole afterwards, and
shutdown ends the child."""

from __future__ import annotations

import asyncio
import threading

import pytest

from streamd.engine.engine_process import ProcessEngine
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


@pytest.mark.parametrize("outputs", ["engine", "network"])
async def test_process_engine_matches_the_offline_engine(smol_llm, outputs: str) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = smol_llm.generate(PROMPTS, params)
    # A stop string taken from the reference's own text, so that it certainly occurs mid-output.
    stop_at = expected[1].outputs[0].text[6:9]
    stopping = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop_at])
    (expected_stop,) = smol_llm.generate(PROMPTS[1:2], stopping)
    assert expected_stop.outputs[0].finish_reason == "stop"
    engine = ProcessEngine(LLMEngine.from_config, smol_llm.config, outputs=outputs)
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
        # (outputs="network": the stop string's StopChoice went to the engine before "long" was added, and
        # commands run in order, so the stats that came with the abort already count it as finished.)
        assert engine.stats().pool_whole and engine.stats().num_requests == 0
    finally:
        await engine.shutdown()
    assert not engine.process.is_alive()
