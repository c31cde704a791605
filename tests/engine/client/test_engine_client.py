"""Both engine clients are an `EngineClient` and behave as one: the same scenario (a streamed request, a
request into a sink of its own, a duplicate id refused, an abort, the pool whole afterwards, refusal after
shutdown) runs on the engine loop on a thread (`AsyncEngine`) and in its own process (`ProcessEngine`, with
outputs made in this process as the server runs it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from streamd.config import Config
from streamd.engine import EngineClient
from streamd.engine.client.async_engine import AsyncEngine
from streamd.engine.client.engine_process import ProcessEngine
from streamd.engine.client.protocol import DuplicateRequestError, EngineDeadError
from streamd.engine.llm_engine import LLMEngine
from streamd.engine.outputs import RequestDelta
from streamd.engine.sampling_params import SamplingParams

PROMPT = "The capital of France is"
SHORT = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


class _Collecting:
    """A sink that is not a stream (as a WebSocket connection's requests are)."""

    def __init__(self) -> None:
        self.deltas: list[RequestDelta] = []
        self.done = asyncio.Event()

    def put(self, delta: RequestDelta) -> None:
        self.deltas.append(delta)
        if delta.finished:
            self.done.set()


def _thread(config: Config) -> EngineClient:
    return AsyncEngine(LLMEngine.from_config(config))


def _process(config: Config) -> EngineClient:
    return ProcessEngine(LLMEngine.from_config, config, outputs="network",
                         batches_ahead=config.engine.batches_ahead)


def _folded(deltas: list[RequestDelta]) -> tuple[list[int], str, str | None]:
    choices = [c for d in deltas for c in d.outputs]
    return [t for c in choices for t in c.token_ids], "".join(c.text for c in choices), choices[-1].finish_reason


@pytest.mark.parametrize("make", [_thread, _process], ids=["thread", "process"])
async def test_both_clients_run_the_same_scenario(smol_llm, make: Callable[..., EngineClient]) -> None:
    (reference,) = smol_llm.generate([PROMPT], SHORT)
    want = (reference.outputs[0].token_ids, reference.outputs[0].text, "length")
    client = make(smol_llm.config)
    assert isinstance(client, EngineClient)
    client.start()
    try:
        assert client.ready and client.dead_reason is None
        assert client.thread_id not in (None, threading.get_native_id()) and client.process_id is not None
        assert client.model_name == smol_llm.engine.model_name
        assert client.max_model_len == smol_llm.engine.max_model_len
        ids = list(client.tokenizer(PROMPT).input_ids)
        stream = await client.add_request("text", PROMPT, SHORT)
        sink = _Collecting()
        await client.submit("ids", None, SHORT, sink, prompt_token_ids=ids)
        with pytest.raises(DuplicateRequestError):
            await client.submit("ids", None, SHORT, _Collecting(), prompt_token_ids=ids)
        streamed = [delta async for delta in stream]
        await asyncio.wait_for(sink.done.wait(), 120)
        assert _folded(streamed) == want and _folded(sink.deltas) == want

        long = await client.add_request("long", PROMPT, LONG)
        await anext(long)
        client.abort("long")
        rest = [delta async for delta in long]
        assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == "abort"
        assert rest[-1].outputs[-1].num_tokens < 400
        stats = client.stats()
        assert stats.pool_whole and stats.num_requests == 0 and client.num_waiting == 0
    finally:
        await client.shutdown()
    assert not client.ready
    with pytest.raises(EngineDeadError):
        await client.add_request("after", PROMPT, SHORT)
