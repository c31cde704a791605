"""Structured outputs and tool calls end to end with the default model: the official `openai` client and the
WebSocket get replies that parse and validate against their schema (greedy and sampled); tool_choice
"required" and a named function give `tool_calls` (streamed and not) and a second turn with the tool's
result completes; bad schemas are refused with a clear error before taking any KV block."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from tests.helpers import sizes
from tests.server.util import Server, gather_until_done, send, ws_connect

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
     "required": ["color", "bright"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "object", "properties": {
        "name": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["name", "zip"],
        "additionalProperties": False}}, "required": ["city"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                           {"enum": ["unknown"]}]}},
     "required": ["answer"], "additionalProperties": False},
]
# 20 prompts, four under each of the five schemas (prompt i under schema i % 5).
QUESTIONS = ["Tell me about a person.", "Pick a colour.", "Give me some tags for a cat photo.", "Where do you live?",
             "How many legs does a spider have?", "Describe your best friend.", "What colour is the sky at dusk?",
             "Tag this photo of a beach.", "Which city has the best food?", "How old is the universe in eons?",
             "Who wrote your favourite book?", "Is grass green or blue?", "List words about winter.",
             "Where is the Eiffel Tower?", "How many days are in a week?", "Name a famous scientist.",
             "Pick the colour of a ripe banana.", "Give tags for a mountain hike.", "Where was pizza invented?",
             "What is 12 times 12?"]
CASES = [(SCHEMAS[i % len(SCHEMAS)], question) for i, question in enumerate(QUESTIONS)]
# Light: the first prompt under each schema (every schema greedy and sampled); full (slow): all 20.
CASE_SIZES = sizes(CASES[:len(SCHEMAS)], CASES)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
        "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
                       "required": ["zone"], "additionalProperties": False}}}
SAMPLED = {"temperature": 0.8, "seed": 7}


@pytest.fixture
def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=600)


def _messages(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question + " Answer in JSON."}]


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


@pytest.mark.parametrize("cases", CASE_SIZES)
async def test_openai_client_outputs_validate(client: AsyncOpenAI, server: Server,
                                              cases: list[tuple[dict[str, Any], str]]) -> None:
    async def one(schema: dict[str, Any], question: str, sampling: dict[str, Any]) -> None:
        reply = await client.chat.completions.create(model=server.services.model_name, messages=_messages(question),
                                                     response_format=_format(schema), max_tokens=80, **sampling)
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
        assert reply.choices[0].finish_reason == "stop"

    await asyncio.gather(*(one(schema, q, sampling) for schema, q in cases
                           for sampling in ({"temperature": 0.0}, SAMPLED)))


@pytest.mark.parametrize("cases", CASE_SIZES)
async def test_websocket_outputs_validate(server: Server, cases: list[tuple[dict[str, Any], str]]) -> None:
    async def one_schema(k: int, schema: dict[str, Any]) -> None:
        async with ws_connect(server) as ws:
            ids = set()
            for i, question in enumerate(q for s, q in cases if s is schema):  # up to 4 x 2: the 8 a socket may run
                for j, sampling in enumerate(({"temperature": 0.0}, SAMPLED)):
                    ids.add(f"{k}-{i}-{j}")
                    params = {"max_tokens": 80, "structured_outputs": {"json": schema}, **sampling}
                    await send(ws, type="generate", id=f"{k}-{i}-{j}", messages=_messages(question), params=params)
            results = await gather_until_done(ws, ids, timeout=600)
        for result in results.values():
            assert result.done["finish_reason"] == "stop"
            jsonschema.validate(json.loads(result.text), schema)

    await asyncio.gather(*(one_schema(k, schema) for k, schema in enumerate(SCHEMAS)))


async def test_parallel_samples_each_validate(client: AsyncOpenAI, server: Server) -> None:
    # n > 1: every choice follows the schema (its own grammar state), and every choice of a required tool
    # call is a call.
    reply = await client.chat.completions.create(model=server.services.model_name, n=3, max_tokens=80,
                                                 messages=_messages(QUESTIONS[0]), response_format=_format(SCHEMAS[0]),
                                                 **SAMPLED)
    assert len(reply.choices) == 3
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[0])
    calls = await client.chat.completions.create(model=server.services.model_name, n=2, max_tokens=60,
                                                 messages=[{"role": "user", "content": "Time in Paris?"}],
                                                 tools=[TIME], tool_choice="required", **SAMPLED)
    assert len(calls.choices) == 2
    for choice in calls.choices:
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


async def test_parallel_samples_stream_their_own_tool_calls(client: AsyncOpenAI, server: Server) -> None:
    # n=2 streamed with a required call: each choice's tool-call deltas come under its own choice index, as
    # that choice's one call (index 0 within it, one id), and add up to arguments that validate.
    stream = await client.chat.completions.create(model=server.services.model_name, n=2, max_tokens=60,
                                                  messages=[{"role": "user", "content": "Time in Paris?"}],
                                                  tools=[TIME], tool_choice="required", stream=True, **SAMPLED)
    ids: dict[int, list[str]] = {0: [], 1: []}
    names: dict[int, list[str]] = {0: [], 1: []}
    pieces: dict[int, list[str]] = {0: [], 1: []}
    finishes: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                assert delta.index == 0, delta
                if delta.id:
                    ids[c.index].append(delta.id)
                    names[c.index].append(delta.function.name)
                pieces[c.index].append(delta.function.arguments or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert finishes == {0: "tool_calls", 1: "tool_calls"}
    assert len(ids[0]) == len(ids[1]) == 1 and ids[0] != ids[1], ids
    assert names == {0: ["get_time"], 1: ["get_time"]}
    for index in (0, 1):
        jsonschema.validate(json.loads("".join(pieces[index])), TIME["function"]["parameters"])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_tool_calls_validate_streamed_and_not(client: AsyncOpenAI, server: Server,
                                                    tool_choice: Any) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    kwargs = {"model": server.services.model_name, "messages": messages, "tools": [WEATHER, TIME],
              "tool_choice": tool_choice, "max_tokens": 60, "temperature": 0.0}
    reply = await client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])

    stream = await client.chat.completions.create(stream=True, **kwargs)
    name, pieces, ids, finish = None, [], set(), None
    async for chunk in stream:
        (c,) = chunk.choices
        for delta in c.delta.tool_calls or []:
            assert delta.index == 0
            ids |= {delta.id} if delta.id else set()
            name = delta.function.name or name
            pieces.append(delta.function.arguments or "")
        finish = c.finish_reason or finish
    assert finish == "tool_calls" and len(ids) == 1 and name == call.function.name
    assert json.loads("".join(pieces)) == json.loads(call.function.arguments)
    assert len([p for p in pieces if p]) > 1  # the arguments arrived in pieces

    # The second turn: the assistant's call and the tool's result go back; the model answers in text.
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "sunny, 21 C"})}]
    answer = await client.chat.completions.create(model=server.services.model_name, messages=follow,
                                                  tools=[WEATHER, TIME], max_tokens=20, temperature=0.0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, message", [
    ({"response_format": _format({"type": "object", "properties": {"a": {"type": "strin"}}})},
     'Unsupported type "strin"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema must be a JSON schema object"),
    ({"response_format": {"type": "xml"}}, "response_format must be an object with type"),
    ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs.regex cannot be compiled"),
    ({"extra_body": {"structured_outputs": {"grammar": "root ::= nope"}}}, 'Rule "nope" is not defined'),
    ({"extra_body": {"structured_outputs": {"jsn": {}}}}, "unknown key"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [TIME], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "naming one of tools"),
])
async def test_bad_specs_get_a_clear_400(client: AsyncOpenAI, server: Server, extra: dict[str, Any],
                                         message: str) -> None:
    with pytest.raises(openai.BadRequestError, match=message):
        await client.chat.completions.create(model=server.services.model_name, messages=_messages("Hi."),
                                             max_tokens=8, **extra)
    used = server.services.engine.stats().kv
    assert used.blocks_free == used.blocks_total


async def test_completions_and_ws_errors(client: AsyncOpenAI, server: Server) -> None:
    reply = await client.completions.create(model=server.services.model_name, prompt="Yes or no? ", max_tokens=8,
                                            temperature=0.0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].text in ("yes", "no")
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="bad", prompt="Hi",
                   params={"response_format": _format({"type": "object", "properties": {"a": {"type": "strin"}}})})
        frame = json.loads(await asyncio.wait_for(ws.recv(), 60))
    assert frame["type"] == "error" and frame["id"] == "bad" and "strin" in frame["error"]["message"], frame
