"""The OpenAI Responses API over HTTP (JSON and SSE) and over WebSocket mode, with the official `openai` SDK
as the client: the same greedy text as `/v1/stream` and `LLM.chat`; several responses multiplexed on one
socket by `stream_id`, one cancelled; `previous_response_id` continuing a conversation from the prefix
cache; OpenAI error bodies / `error` events that leave the socket open; a drain closing with 1012."""

from __future__ import annotations

import asyncio
import json
import signal
from typing import Any

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from websockets.exceptions import ConnectionClosed

from streamd.engine.sampling_params import SamplingParams
from tests.server.util import Server, gather_until_done, running_server, send, ws_connect

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 12


def client_for(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def client(server: Server) -> AsyncOpenAI:
    return client_for(server)


def _check_events(events: list[Any]) -> str:
    """The event order a text response has; returns the text the deltas add up to."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    if len(events) > 1 and events[1].type == "response.queued":  # it waited in the engine's queue (issue 32)
        assert events[1].response.status == "queued"
        events = events[:1] + events[2:]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"], kinds
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"], kinds
    status = events[-1].response.status  # the terminal event follows the status
    assert kinds[-1] == ("response.completed" if status == "completed" else "response.incomplete"), (kinds, status)
    assert (events[-1].response.incomplete_details is None) == (status != "incomplete"), events[-1].response
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}, kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (item,) = events[-1].response.output
    assert events[-4].text == text and "".join(part.text for part in item.content) == text
    return text


async def test_create_equals_the_websocket_and_llm_chat(client: AsyncOpenAI, server: Server, async_engine,
                                                        smol_llm) -> None:
    params = {"max_tokens": TOKENS, "temperature": 0.0}
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="w", messages=MESSAGES, params=params)
        via_ws = (await gather_until_done(ws, {"w"}))["w"]
    (reference,) = await async_engine.call(lambda _: smol_llm.chat(MESSAGES, SamplingParams(**params)))
    plain = await client.responses.create(model=server.services.model_name, input=MESSAGES[0]["content"],
                                          max_output_tokens=TOKENS, temperature=0.0, metadata={"k": "v"})
    assert plain.output_text == via_ws.text == reference.outputs[0].text
    status = {"stop": "completed", "length": "incomplete"}[reference.outputs[0].finish_reason]
    assert plain.status == status
    assert plain.incomplete_details is None if status == "completed" else \
        plain.incomplete_details.reason == "max_output_tokens"
    completion = len(reference.outputs[0].token_ids)
    assert plain.usage.output_tokens == completion and plain.usage.input_tokens == len(reference.prompt_token_ids)
    assert plain.metadata == {"k": "v"} and plain.id.startswith("resp_")
    events = [e async for e in await client.responses.create(
        model=server.services.model_name, input=[{"role": "user", "content": [
            {"type": "input_text", "text": MESSAGES[0]["content"]}]}],
        max_output_tokens=TOKENS, temperature=0.0, stream=True, top_logprobs=2)]
    assert _check_events(events) == plain.output_text
    first = next(e for e in events if e.type == "response.output_text.delta").logprobs[0]
    assert len(first.top_logprobs) >= 2 and first.logprob == max(t.logprob for t in first.top_logprobs)
    assert events[-1].response.status == status and events[-1].response.usage.output_tokens == completion
    # The SDK's own stream accumulator accepts the event sequence (it needs a response that completes).
    assert status == "completed", "pick a request that stops before max_output_tokens"
    async with client.responses.stream(model=server.services.model_name, input=MESSAGES[0]["content"],
                                       max_output_tokens=TOKENS, temperature=0.0) as stream:
        final = await stream.get_final_response()
    assert final.output_text == plain.output_text


async def test_http_errors_are_openai_bodies(client: AsyncOpenAI, server: Server) -> None:
    model = server.services.model_name
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"model": "nope", "input": "x"}, openai.NotFoundError, "model_not_found"),
        ({"model": model, "input": 5}, openai.BadRequestError, "invalid_request"),
        ({"model": model, "input": "x", "max_output_tokens": "many"}, openai.BadRequestError, "invalid_request"),
        ({"model": model, "input": "x", "temperature": "hot"}, openai.BadRequestError, "invalid_request"),
        ({"model": model, "input": "x", "store": "yes"}, openai.BadRequestError, "invalid_request"),
        ({"model": model, "input": "x " * 9000}, openai.BadRequestError, "context_length_exceeded"),
        ({"model": model, "input": "x", "previous_response_id": "resp_nope"}, openai.BadRequestError,
         "previous_response_not_found"),
        ({"model": model, "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}},
         openai.BadRequestError, "invalid_request"),
        ({"model": model, "input": "x", "text": {"format": {"type": "yaml"}}}, openai.BadRequestError,
         "invalid_request"),
    ]
    for body, kind, code in cases:
        with pytest.raises(kind) as caught:
            await client.responses.create(**body)
        assert caught.value.body["code"] == code, (body, caught.value.body)
        assert caught.value.body["message"]
        if "text" in body:
            assert caught.value.body["param"] == "text.format", caught.value.body
            if body["text"]["format"]["type"] == "json_schema":  # the missing field, as the Responses API names it
                assert caught.value.body["message"] == "text.format.schema must be a JSON schema object"


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer"}},
          "required": ["city", "population"], "additionalProperties": False}


async def test_text_format_constrains_the_reply(client: AsyncOpenAI, server: Server) -> None:
    """`text.format` json_schema and json_object: the reply parses (and validates), streamed and not; the
    response echoes the format."""
    model = server.services.model_name
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}}
    reply = await client.responses.create(model=model, input="Name a big city and its population.", text=fmt,
                                          max_output_tokens=64, temperature=0.0)
    jsonschema.validate(json.loads(reply.output_text), SCHEMA)
    assert reply.text.format.type == "json_schema"
    stream = await client.responses.create(model=model, input="Name a big city and its population.", text=fmt,
                                           max_output_tokens=64, temperature=0.0, stream=True)
    events = [event async for event in stream]
    assert json.loads(_check_events(events)) == json.loads(reply.output_text)
    loose = await client.responses.create(model=model, input="Describe Paris as JSON.",
                                          text={"format": {"type": "json_object"}}, max_output_tokens=96,
                                          temperature=0.0)
    assert loose.status == "completed", loose.output_text
    assert isinstance(json.loads(loose.output_text), dict), loose.output_text


async def test_previous_response_id_over_http_and_store_false(client: AsyncOpenAI, server: Server) -> None:
    model = server.services.model_name
    first = await client.responses.create(model=model, input="Name a color.", max_output_tokens=6, temperature=0)
    second = await client.responses.create(model=model, input="Another one?", previous_response_id=first.id,
                                           max_output_tokens=6, temperature=0)
    assert second.usage.input_tokens_details.cached_tokens >= 16 * (
        (first.usage.input_tokens + first.usage.output_tokens) // 16) - 16
    unstored = await client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=model, input="x", previous_response_id=unstored.id)
    assert caught.value.body["code"] == "previous_response_not_found"


async def test_websocket_multiplexes_cancels_and_continues(server: Server, async_engine) -> None:
    client = client_for(server)
    model = server.services.model_name
    async with client.beta.responses.connect() as conn:
        for lane, tokens in (("a", TOKENS), ("b", 400), ("c", TOKENS)):
            await conn.response.create(model=model, input=MESSAGES[0]["content"], max_output_tokens=tokens,
                                       temperature=0.0, stream_id=lane)
        events: dict[str, list[Any]] = {"a": [], "b": [], "c": []}
        cancelled = False
        while not all(e and e[-1].type.startswith("response.") and e[-1].type in (
                "response.completed", "response.incomplete") for e in events.values()):
            event = await conn.recv()
            events[event.stream_id].append(event)
            if event.type == "response.output_text.delta" and event.stream_id == "b" and not cancelled:
                await conn.send({"type": "response.cancel", "response_id": events["b"][0].response.id})
                cancelled = True
        texts = {lane: _check_events(e) for lane, e in events.items()}
        assert texts["a"] == texts["c"] and events["a"][-1].response.status == events["c"][-1].response.status
        assert events["b"][-1].response.status == "cancelled"
        assert events["b"][-1].response.usage.output_tokens < 400
        # An error event leaves the socket open: a bad request, then a good one on the same lane.
        await conn.response.create(model="nope", input="x", stream_id="a")
        error = await conn.recv()
        assert error.type == "error" and error.error.code == "model_not_found" and error.stream_id == "a"
        await conn.response.create(model=model, input="x", previous_response_id="resp_unknown")
        error = await conn.recv()
        assert error.type == "error" and error.error.code == "previous_response_not_found"
        # previous_response_id on the socket equals sending the whole history, and hits the cache.
        first_id = events["a"][0].response.id
        await conn.response.create(model=model, input="And of Italy?", previous_response_id=first_id,
                                   max_output_tokens=TOKENS, temperature=0.0, store=False)
        continued = [await conn.recv()]
        while continued[-1].type not in ("response.completed", "response.incomplete"):
            continued.append(await conn.recv())
    whole = [*MESSAGES, {"role": "assistant", "content": texts["a"]}, {"role": "user", "content": "And of Italy?"}]
    again = await client.responses.create(model=model, input=whole, max_output_tokens=TOKENS, temperature=0.0)
    usage = continued[-1].response.usage
    assert _check_events(continued) == again.output_text
    first_usage = events["a"][-1].response.usage
    assert usage.input_tokens_details.cached_tokens >= first_usage.input_tokens + first_usage.output_tokens - 16
    assert usage.input_tokens == again.usage.input_tokens


async def test_sync_connect(server: Server) -> None:
    """The SDK's synchronous WebSocket client (run on a thread: the server shares this test's loop)."""
    outcome: dict[str, Any] = {}

    def talk() -> None:
        client = OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)
        with client.beta.responses.connect() as conn:
            conn.response.create(model=server.services.model_name, input="Hi", max_output_tokens=4,
                                 temperature=0.0)
            events = [conn.recv()]
            while events[-1].type not in ("response.completed", "response.incomplete"):
                events.append(conn.recv())
            outcome["events"] = events

    await asyncio.wait_for(asyncio.to_thread(talk), 120)
    assert _check_events(outcome["events"])


async def test_drain_closes_with_1012_and_the_sdk_reconnects(async_engine) -> None:
    async with running_server(async_engine, drain_timeout_s=60.0) as srv:
        reconnects: list[int] = []

        def on_reconnecting(event: Any) -> dict[str, Any]:
            reconnects.append(event.close_code)
            return {"abort": True}

        async with client_for(srv).beta.responses.connect(on_reconnecting=on_reconnecting) as conn:
            await conn.response.create(model=srv.services.model_name, input="Hi", max_output_tokens=8,
                                       temperature=0.0)
            events: list[Any] = []
            with pytest.raises(ConnectionClosed) as closed:
                async for event in conn:  # the SDK's iterator is what reconnects
                    events.append(event)
                    if len(events) == 1:
                        srv.uvicorn.handle_exit(signal.SIGTERM, None)  # what the SIGTERM handler does
        assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 8
        assert reconnects == [1012] and closed.value.rcvd.code == 1012
    metrics = srv.services.metrics  # (the server has shut down: its handlers are done) counted as every socket
    assert metrics.ws_closes.labels("1012")._value.get() == 1 and metrics.ws_connections._value.get() == 0
