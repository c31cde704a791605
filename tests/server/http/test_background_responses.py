"""Background Responses (issue 32) through the official `openai` SDK against a real server:
`responses.create(background=True)` then `retrieve` until it is done (the same text as a plain response),
a stream cut mid-way and resumed with `retrieve(id, stream=True, starting_after=N)` (every sequence number
once, the same text), `cancel` (status cancelled, KV blocks freed: the autouse idle check), `delete`, and the
binding to the API key that created it. A light form of `streamd bench chaos --scenario background-kills`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import Server, running_server

PROMPT = "Name three colours and say why you like them."
GREEDY: dict[str, Any] = {"input": PROMPT, "max_output_tokens": 24, "temperature": 0}


def _client(server: Server, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key=key, max_retries=0, timeout=120)


async def _until_done(client: AsyncOpenAI, response_id: str) -> Any:
    deadline = time.monotonic() + 120
    while True:
        got = await client.responses.retrieve(response_id)
        if got.status not in ("queued", "in_progress"):
            return got
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.05)  # polling the API, as an SDK user does (not synchronization of the test)


def _text(events: list[Any]) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


async def test_create_in_background_and_retrieve(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    plain = await client.responses.create(model=model, **GREEDY)
    started = await client.responses.create(model=model, background=True, **GREEDY)
    assert started.status in ("queued", "in_progress") and started.background is True
    done = await _until_done(client, started.id)
    assert done.status == plain.status and done.output_text == plain.output_text
    # a finished background response is a stored one: it can be continued
    follow = await client.responses.create(model=model, input="And a fourth?", previous_response_id=done.id,
                                           max_output_tokens=4)
    assert follow.status in ("completed", "incomplete")


async def test_a_cut_stream_resumes_after_its_last_event(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    whole = [e async for e in await client.responses.create(model=model, stream=True, **GREEDY)]
    first: list[Any] = []
    stream = await client.responses.create(model=model, background=True, stream=True, **GREEDY)
    async for event in stream:
        first.append(event)
        if event.type == "response.output_text.delta" and len(_text(first)) > 5:
            break
    await stream.close()  # the TCP connection goes; the response runs on
    response_id = first[0].response.id
    rest = [e async for e in await client.responses.retrieve(
        response_id, stream=True, starting_after=first[-1].sequence_number)]
    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _text(events) == _text(whole) and events[-1].type == whole[-1].type
    again = [e async for e in await client.responses.retrieve(response_id, stream=True, starting_after=-1)]
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]  # the whole, replayed


async def test_cancel_and_delete(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    started = await client.responses.create(model=model, background=True, input="Write a very long story.",
                                            max_output_tokens=2000, temperature=0)
    cancelled = await client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(started.id)).status == "cancelled"
    await client.responses.delete(started.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(started.id)


async def test_bound_to_the_key_that_created_it(async_engine: AsyncEngine) -> None:
    async with running_server(async_engine, api_keys=["key-a", "key-b"]) as srv:
        mine, theirs = _client(srv, "key-a"), _client(srv, "key-b")
        started = await mine.responses.create(model=srv.services.model_name, background=True, **GREEDY)
        for call in (theirs.responses.retrieve, theirs.responses.cancel, theirs.responses.delete):
            with pytest.raises(openai.NotFoundError):
                await call(started.id)
        assert (await _until_done(mine, started.id)).status in ("completed", "incomplete")


async def test_refusals_name_the_field(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    with pytest.raises(openai.BadRequestError, match="store"):
        await client.responses.create(model=model, background=True, store=False, **GREEDY)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_unknown")


async def test_retention_is_bounded(async_engine: AsyncEngine) -> None:
    """With room for one: a second is refused (503) while the first runs, and evicts it once it has ended."""
    async with running_server(async_engine, max_background_responses=1) as srv:
        client, model = _client(srv), srv.services.model_name
        first = await client.responses.create(model=model, background=True, input="Write a very long story.",
                                              max_output_tokens=2000, temperature=0)
        with pytest.raises(openai.InternalServerError, match="max_background_responses"):
            await client.responses.create(model=model, background=True, **GREEDY)
        await client.responses.cancel(first.id)
        second = await client.responses.create(model=model, background=True, **GREEDY)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        assert (await _until_done(client, second.id)).status in ("completed", "incomplete")
