"""`engine.process`: the real server over an engine in its own process, detokenizing in the server
process (`ProcessEngine(outputs="network")`): `/v1/stream` (v1 and v2 framing) and streamed
`/v1/completions` give the offline engine's greedy tokens and text (and echo with logprobs its prompt
logprobs); a structured request is constrained (its
grammar compiled in the engine process) and a bad grammar is refused with a 400 naming it; the pool is whole
afterwards."""

from __future__ import annotations

import openai
import pytest

from streamd.engine.client.engine_process import ProcessEngine
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.sampling_params import SamplingParams
from tests.server.util import gather_until_done, running_server, send, ws_connect

PROMPT = "The three primary colors are"


async def test_engine_process_server_matches_the_offline_engine(smol_llm, async_engine) -> None:
    # The reference runs on the session engine's thread: the shared model must never step on two threads.
    (expected,) = await async_engine.call(
        lambda _: smol_llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)))
    want = expected.outputs[0]
    engine = ProcessEngine(LLMEngine.from_config, smol_llm.config, outputs="network",
                           batches_ahead=smol_llm.config.engine.batches_ahead)
    try:
        async with running_server(engine) as srv:
            for subprotocol in ("streamd.v1", "streamd.v2"):
                async with ws_connect(srv, subprotocols=[subprotocol]) as ws:
                    await send(ws, type="generate", id="a", prompt=PROMPT,
                               params={"max_tokens": 10, "temperature": 0, "ignore_eos": True})
                    got = (await gather_until_done(ws, {"a"}))["a"]
                assert (got.token_ids, got.text, got.done["finish_reason"]) == (want.token_ids, want.text, "length")
            client = openai.AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=120)
            stream = await client.completions.create(model=srv.services.model_name, prompt=PROMPT, max_tokens=10,
                                                     temperature=0.0, stream=True, extra_body={"ignore_eos": True})
            text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
            assert text == want.text
            echoed = await client.completions.create(model=srv.services.model_name, prompt=PROMPT, max_tokens=3,
                                                     temperature=0.0, echo=True, logprobs=1)
            lp = echoed.choices[0].logprobs  # the prompt logprobs crossed the process wire with the first delta
            num_prompt = len(smol_llm.engine.tokenizer(PROMPT).input_ids)
            assert len(lp.tokens) == len(lp.token_logprobs) == num_prompt + 3 and lp.token_logprobs[0] is None
            assert all(v is not None for v in lp.token_logprobs[1:])
            choice = await client.completions.create(
                model=srv.services.model_name, prompt="Yes or no? ", max_tokens=8, temperature=0.0,
                extra_body={"structured_outputs": {"choice": ["maybe so", "no"]}})
            assert choice.choices[0].text in ("maybe so", "no")
            with pytest.raises(openai.BadRequestError, match="structured_outputs.regex cannot be compiled"):
                await client.completions.create(model=srv.services.model_name, prompt="Hi", max_tokens=4,
                                                extra_body={"structured_outputs": {"regex": "(ab"}})
        assert engine.stats().pool_whole and engine.stats().num_requests == 0
    finally:
        await engine.shutdown()
    assert not engine.process.is_alive()
