"""Function tools on the Responses API (HTTP and WebSocket mode) and on `/v1/stream`, with the default model
and the official `openai` SDK: `tool_choice="required"` makes the reply a grammar-enforced call (any model can
then call), which must come back as a `function_call` item (call_id, name, JSON arguments), streamed as
`response.function_call_arguments.delta/done`; a follow-up's `function_call_output` reaches the template as
the tool message chat completions would render. On `/v1/stream` the call arrives as `tool_calls` deltas."""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

from tests.server.util import Server, gather_until_done, send, ws_connect

TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
QUESTION = "What is the weather in Paris?"


def _client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=300)


def _args(**extra: Any) -> dict[str, Any]:
    return {"input": QUESTION, "tools": [TOOL], "tool_choice": "required", "max_output_tokens": 60,
            "temperature": 0.0, **extra}


async def test_a_required_call_is_a_function_call_item_streamed_and_not(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    reply = await client.responses.create(model=model, **_args())
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and reply.status == "completed"
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert reply.tools[0].name == "get_weather"

    events = [e async for e in await client.responses.create(model=model, stream=True, **_args())]
    kinds = [e.type for e in events]
    assert "response.output_item.added" in kinds and kinds[-1] == "response.completed", kinds
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == pieces == call.arguments  # (greedy: the same call)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    async with client.responses.stream(model=model, **_args()) as stream:  # the SDK's own accumulator
        final = await stream.get_final_response()
    assert [item.arguments for item in final.output if item.type == "function_call"] == [call.arguments]


async def test_function_call_output_reaches_the_template_as_a_tool_message(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    first = await client.responses.create(model=model, **_args())
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    follow = await client.responses.create(model=model, previous_response_id=first.id, input=[output],
                                           tools=[TOOL], max_output_tokens=6, temperature=0.0)
    assert follow.status in ("completed", "incomplete") and follow.output[0].type == "message"
    # The same conversation sent whole (the call item as the SDK returned it) renders as chat completions'.
    whole = await client.responses.create(
        model=model, tools=[TOOL], max_output_tokens=6, temperature=0.0,
        input=[{"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), output])
    chat = await client.chat.completions.create(
        model=model, tools=[CHAT_TOOL], max_tokens=6, temperature=0.0, messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert whole.usage.input_tokens == follow.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.output_text == follow.output_text == chat.choices[0].message.content


async def test_websocket_mode_streams_the_call(server: Server) -> None:
    client = _client(server)
    async with client.beta.responses.connect() as conn:
        await conn.response.create(model=server.services.model_name, **_args())
        events = []
        while not events or events[-1].type not in ("response.completed", "response.incomplete", "error"):
            events.append(await conn.recv())
    (item,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert item.type == "function_call" and item.name == "get_weather"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == item.arguments


async def test_the_stream_socket_sends_tool_call_deltas(server: Server) -> None:
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="c", messages=[{"role": "user", "content": QUESTION}],
                   tools=[CHAT_TOOL], tool_choice="required", params={"max_tokens": 60, "temperature": 0.0})
        await send(ws, type="generate", id="bad", prompt="x", tools=[CHAT_TOOL])
        results = await gather_until_done(ws, {"c"}, stray=(stray := []))
    deltas = [d for f in results["c"].of("delta") for d in f.get("tool_calls", [])]
    assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert isinstance(json.loads(arguments)["city"], str)
    assert results["c"].text == ""  # the call's text is not content
    assert results["c"].done["finish_reason"] == "tool_calls"
    assert [f["id"] for f in stray if f["type"] == "error"] == ["bad"]
