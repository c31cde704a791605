"""tool_choice="auto" parses the model's own tool-call format, chosen from its real chat template: a
random-weight Qwen2 with Qwen2.5-Instruct's template (Hermes `<tool_call>` blocks) and a random-weight Llama
with Llama 3.2-Instruct's template (a JSON call). The random models cannot be asked to call a tool, so a
regex (`structured_outputs`) makes each reply a call in its family's format, or plain text; the official
`openai` client must then get `tool_calls` (streamed and not) with finish reason "tool_calls", or the text."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config

from tests.chat_templates import LLAMA_3_2_TEMPLATE, QWEN_2_5_TEMPLATE
from tests.server.util import Server, templated_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}}
# What each family's model writes when it calls get_weather (its template's own format).
CALL_REGEX = {
    "qwen2": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}\n</tool_call>',
    "llama": r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome|Oslo)"\}\}',
}
FAMILIES: dict[str, tuple[type[PretrainedConfig], str]] = {
    "qwen2": (Qwen2Config, QWEN_2_5_TEMPLATE), "llama": (LlamaConfig, LLAMA_3_2_TEMPLATE)}


@pytest_asyncio.fixture(params=sorted(FAMILIES), loop_scope="session")
async def family_server(request: pytest.FixtureRequest) -> AsyncIterator[tuple[str, Server]]:
    family = request.param
    config_class, template = FAMILIES[family]
    async with templated_server(config_class, template, seed=5) as srv:
        yield family, srv


def _request(srv: Server, regex: str, **extra: Any) -> dict[str, Any]:
    return {"model": srv.services.model_name, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER], "max_tokens": 80, "temperature": 0.0,
            "extra_body": {"structured_outputs": {"regex": regex}}, **extra}


async def test_auto_parses_the_families_own_tool_calls(family_server: tuple[str, Server]) -> None:
    family, srv = family_server
    client = AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=300)
    kwargs = _request(srv, CALL_REGEX[family])
    reply = await client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")

    stream = await client.chat.completions.create(stream=True, **kwargs)
    name, pieces, content, finish = None, [], "", None
    async for chunk in stream:
        (c,) = chunk.choices
        content += c.delta.content or ""
        for delta in c.delta.tool_calls or []:
            assert delta.index == 0
            name = delta.function.name or name
            pieces.append(delta.function.arguments or "")
        finish = c.finish_reason or finish
    assert finish == "tool_calls" and name == "get_weather" and content == ""
    assert json.loads("".join(pieces)) == json.loads(call.function.arguments)  # greedy: the same call

    # The second turn: the call and the tool's result go back through the family's template.
    follow = kwargs["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = await client.chat.completions.create(**{**_request(srv, r"It is (sunny|warm)\."), "messages": follow})
    assert answer.choices[0].message.content in ("It is sunny.", "It is warm.")
    assert answer.choices[0].finish_reason == "stop"


async def test_auto_without_a_call_is_plain_text(family_server: tuple[str, Server]) -> None:
    _, srv = family_server
    client = AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=300)
    kwargs = _request(srv, r"It is (sunny|raining) in Paris\.")
    reply = await client.chat.completions.create(**kwargs)
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    text = reply.choices[0].message.content
    assert text in ("It is sunny in Paris.", "It is raining in Paris.")
    stream = await client.chat.completions.create(stream=True, **kwargs)
    chunks = [chunk.choices[0] async for chunk in stream]
    assert "".join(c.delta.content or "" for c in chunks) == text
    assert not any(c.delta.tool_calls for c in chunks) and chunks[-1].finish_reason == "stop"
