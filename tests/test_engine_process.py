"""The engine in its own process (`ProcessEngine`, the issue-9 prototype): the default model in a child
process gives the same tokens and text as the offline engine, an abort ends its request with "abort", the
pool is whole afterwards, and shutdown ends the child."""

from __future__ import annotations

import asyncio

from streamd.engine.engine_process import ProcessEngine
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.outputs import RequestOutputBuilder
from streamd.engine.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]


async def _fold(engine: ProcessEngine, request_id: str, prompt: str, params: SamplingParams) -> RequestOutputBuilder:
    stream = await engine.add_request(request_id, prompt, params)
    builder = RequestOutputBuilder(request_id, prompt, [])
    async for delta in stream:
        builder.add(delta)
    return builder


async def test_process_engine_matches_the_offline_engine(smol_llm) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = smol_llm.generate(PROMPTS, params)
    engine = ProcessEngine(LLMEngine.from_config, smol_llm.config)
    engine.start()
    try:
        assert engine.model_name == smol_llm.engine.model_name and engine.ready
        builders = await asyncio.gather(*(_fold(engine, f"p{i}", p, params) for i, p in enumerate(PROMPTS)))
        for builder, reference in zip(builders, expected):
            (got,) = builder.build().outputs
            assert got.token_ids == reference.outputs[0].token_ids and got.text == reference.outputs[0].text
            assert got.finish_reason == "length"
        long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
        stream = await engine.add_request("long", PROMPTS[0], long)
        first = await anext(stream)
        engine.abort("long")
        last = first
        async for last in stream:
            pass
        assert last.finished and last.outputs[-1].finish_reason == "abort"
        assert engine.stats().pool_whole and engine.stats().num_requests == 0
    finally:
        await engine.shutdown()
    assert not engine.process.is_alive()
