"""Beam search through the APIs: WebSocket `params` and the official `openai` client (vLLM's
`use_beam_search` extra field) return the engine's best `n` beams, each choice with its index, delivered
whole at the end; invalid combinations get clear errors; cancelling or disconnecting mid-way frees every
beam's blocks."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from streamd import SamplingParams
from tests.server.util import Server, check_stream, gather_until_done, recv, send, ws_connect

QUESTION = "What is the capital of France?"
BEAMS = {"use_beam_search": True, "beam_width": 3, "early_stopping": True}


@pytest.fixture
def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


async def _reference(async_engine, smol_llm, n: int, max_tokens: int, chat: bool) -> list[str]:
    params = SamplingParams(n=n, max_tokens=max_tokens, **BEAMS)
    prompt = [{"role": "user", "content": QUESTION}] if chat else QUESTION
    run = (lambda _: smol_llm.chat(prompt, params)) if chat else (lambda _: smol_llm.generate(prompt, params))
    (out,) = await async_engine.call(run)
    return [choice.text for choice in out.outputs]


async def test_websocket_returns_the_best_beams(server: Server, async_engine, smol_llm) -> None:
    want = await _reference(async_engine, smol_llm, 2, 12, chat=True)
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="b", messages=[{"role": "user", "content": QUESTION}],
                   params={**BEAMS, "n": 2, "max_tokens": 12})
        result = (await gather_until_done(ws, {"b"}))["b"]
    check_stream(result)
    deltas = result.of("delta")
    assert sorted(f["index"] for f in deltas) == [0, 1]  # each beam whole, once, at the end
    assert [next(f["text"] for f in deltas if f["index"] == i) for i in range(2)] == want
    assert len(result.done["finish_reasons"]) == 2 and result.done["finish_reason"] in ("stop", "length")


async def test_openai_client_with_use_beam_search(client: AsyncOpenAI, server: Server, async_engine,
                                                  smol_llm) -> None:
    model = server.services.model_name
    want = await _reference(async_engine, smol_llm, 3, 10, chat=False)
    plain = await client.completions.create(model=model, prompt=QUESTION, n=3, max_tokens=10, extra_body=BEAMS)
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == want
    assert plain.usage.completion_tokens >= 3
    stream = await client.completions.create(model=model, prompt=QUESTION, n=3, max_tokens=10, extra_body=BEAMS,
                                             stream=True)
    pieces: dict[int, str] = {0: "", 1: "", 2: ""}
    async for chunk in stream:
        (choice,) = chunk.choices
        pieces[choice.index] += choice.text
    assert [pieces[i] for i in range(3)] == want
    # vLLM's legacy form: best_of is the beam width, n how many beams come back.
    legacy = await client.completions.create(model=model, prompt=QUESTION, n=2, best_of=3, max_tokens=10,
                                             extra_body={"use_beam_search": True, "early_stopping": True})
    assert [c.text for c in sorted(legacy.choices, key=lambda c: c.index)] == want[:2]

    chat_want = await _reference(async_engine, smol_llm, 2, 12, chat=True)
    chat = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                n=2, max_tokens=12, extra_body=BEAMS)
    assert [c.message.content for c in sorted(chat.choices, key=lambda c: c.index)] == chat_want


async def test_beams_follow_response_format(client: AsyncOpenAI, server: Server) -> None:
    """Beam search and a JSON schema together over the OpenAI route: every returned beam validates."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
              "additionalProperties": False}
    reply = await client.chat.completions.create(
        model=server.services.model_name, messages=[{"role": "user", "content": "Name a city in France as JSON."}],
        n=2, max_tokens=24, extra_body=BEAMS,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert sorted(c.index for c in reply.choices) == [0, 1]
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
    assert len({c.message.content for c in reply.choices}) == 2


@pytest.mark.parametrize("extra, field", [
    ({"temperature": 0.7}, "temperature"), ({"top_p": 0.5}, "top_p"), ({"stop": ["."]}, "stop"),
    ({"n": 4}, "n"),
    ({"beam_width": 17}, "beam_width"), ({"early_stopping": "sometimes"}, "early_stopping"),
])
async def test_invalid_beam_requests_are_refused(client: AsyncOpenAI, server: Server, extra: dict,
                                                 field: str) -> None:
    body = {**BEAMS, **extra}
    with pytest.raises(openai.BadRequestError, match=field):
        await client.completions.create(model=server.services.model_name, prompt=QUESTION, max_tokens=5,
                                        extra_body=body)
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="bad", prompt=QUESTION, params={**body, "max_tokens": 5})
        frame = await recv(ws)
    assert frame["type"] == "error" and field in frame["error"]["message"]


async def _until_beams_forked(async_engine, width: int) -> None:
    """Waits (one engine step per round trip) until a beam group runs `width` beams past its prompt."""
    def forked(engine) -> bool:
        return any(g.sampling_params.use_beam_search and len(g.seqs) == width and g.seqs[0].num_output_tokens > 2
                   for g in engine.scheduler.running)
    while not await async_engine.call(forked):
        pass


async def test_cancel_or_disconnect_mid_search_frees_every_beam(server: Server, async_engine) -> None:
    params = {"use_beam_search": True, "beam_width": 3, "n": 2, "max_tokens": 1000, "ignore_eos": True}
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="c", prompt="Write an essay.", params=params)
        assert (await recv(ws))["type"] == "start"
        await _until_beams_forked(async_engine, 3)
        await send(ws, type="cancel", id="c")
        result = (await gather_until_done(ws, {"c"}))["c"]
        assert result.done["finish_reasons"] == ["cancelled"] * 2
        stats = await async_engine.wait_idle(timeout=60)
        assert stats.kv.blocks_free == stats.kv.blocks_total
        await send(ws, type="generate", id="d", prompt="Write an essay.", params=params)
        assert (await recv(ws))["type"] == "start"
        await _until_beams_forked(async_engine, 3)
    # The socket closed with the search in flight: the server aborts it and every beam's blocks come back.
    stats = await async_engine.wait_idle(timeout=60)
    assert stats.kv.blocks_free == stats.kv.blocks_total
