"""`n` through the APIs: the official `openai` client gets n choices (streaming and not) with distinct indices
and usage over all choices; WebSocket deltas carry their index and `done` has one finish reason per choice;
the same seeded request gives the same choices on every route; cancelling a group frees all its blocks."""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

from tests.server.util import Server, check_stream, gather_until_done, recv, send, ws_connect

PROMPT = "My favourite animal is"
PARAMS = {"max_tokens": 6, "temperature": 1.0, "seed": 42, "n": 3}


@pytest.fixture
def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


async def test_completions_with_n_streaming_and_not(client: AsyncOpenAI, server: Server) -> None:
    model = server.services.model_name
    plain = await client.completions.create(model=model, prompt=PROMPT, extra_body={"ignore_eos": True}, **PARAMS)
    assert sorted(c.index for c in plain.choices) == [0, 1, 2]
    assert {c.finish_reason for c in plain.choices} == {"length"}
    assert plain.usage.completion_tokens == 3 * PARAMS["max_tokens"]
    texts = {c.index: c.text for c in plain.choices}
    assert len(set(texts.values())) >= 2, texts
    stream = await client.completions.create(model=model, prompt=PROMPT, stream=True, extra_body={"ignore_eos": True},
                                             stream_options={"include_usage": True}, **PARAMS)
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    finishes, usage = {}, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        pieces[choice.index].append(choice.text)
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert {i: "".join(p) for i, p in pieces.items()} == texts  # seeded: the same samples again
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert usage is not None and usage.completion_tokens == 3 * PARAMS["max_tokens"]

    # The WebSocket gets the same samples, each delta with its index, and a finish reason per choice.
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="n3", prompt=PROMPT, params={**PARAMS, "ignore_eos": True})
        result = (await gather_until_done(ws, {"n3"}))["n3"]
    check_stream(result)
    by_index = {i: "".join(f["text"] for f in result.of("delta") if f["index"] == i) for i in range(3)}
    assert by_index == texts
    assert result.done["finish_reasons"] == ["length"] * 3
    assert result.done["usage"]["completion_tokens"] == 3 * PARAMS["max_tokens"]


async def test_chat_with_n_streaming_and_not(client: AsyncOpenAI, server: Server) -> None:
    model, messages = server.services.model_name, [{"role": "user", "content": "Name a colour."}]
    plain = await client.chat.completions.create(model=model, messages=messages, **PARAMS)
    assert sorted(c.index for c in plain.choices) == [0, 1, 2]
    assert all(c.message.role == "assistant" for c in plain.choices)
    contents = {c.index: c.message.content for c in plain.choices}
    stream = await client.chat.completions.create(model=model, messages=messages, stream=True,
                                                  stream_options={"include_usage": True}, **PARAMS)
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    roles, finishes, usage = {}, {}, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            continue
        (choice,) = chunk.choices
        roles.setdefault(choice.index, choice.delta.role)
        pieces[choice.index].append(choice.delta.content or "")
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert {i: "".join(p) for i, p in pieces.items()} == contents
    assert finishes == {c.index: c.finish_reason for c in plain.choices}
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    assert plain.usage.completion_tokens >= 3


async def test_cancelling_a_group_frees_every_sample(server: Server, async_engine) -> None:
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="many", prompt="Write an essay.",
                   params={"n": 4, "max_tokens": 2000, "ignore_eos": True})
        assert (await recv(ws))["type"] == "start"
        assert (await recv(ws))["type"] == "delta"
        await send(ws, type="cancel", id="many")
        result = (await gather_until_done(ws, {"many"}))["many"]
    assert result.done["finish_reason"] == "cancelled"
    assert result.done["finish_reasons"] == ["cancelled"] * 4
    stats = await async_engine.wait_idle(timeout=60)
    assert stats.kv.blocks_free == stats.kv.blocks_total
