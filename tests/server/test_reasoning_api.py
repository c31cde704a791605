"""Reasoning models over the real server: a random-weight Qwen2 with a DeepSeek-R1-style chat template that
opens `<think>` in the prompt (unless `chat_template_kwargs` says `enable_thinking: false`). The random model
cannot be asked to reason, so a regex (`structured_outputs`) writes each reply; the official `openai` client must
get `reasoning_content` apart from `content`, streamed and not. `thinking_token_budget` forces the model's
`</think>` after that many output tokens (checked on the token ids of `/v1/stream`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
from openai import AsyncOpenAI
from transformers import Qwen2Config

from tests.server.util import Server, gather_until_done, send, templated_server, ws_connect

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}"
)
REPLY = r"Hmm, (yes|no)\.</think>\n\nThe answer is (yes|no)\."
MESSAGES = [{"role": "user", "content": "Is it?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def think_server() -> AsyncIterator[Server]:
    async with templated_server(Qwen2Config, THINKING_TEMPLATE, seed=7) as srv:
        yield srv


def _client(srv: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=300)


def _request(srv: Server, regex: str, **extra: Any) -> dict[str, Any]:
    return {"model": srv.services.model_name, "messages": MESSAGES, "max_tokens": 60, "temperature": 0.0,
            "extra_body": {"structured_outputs": {"regex": regex}, **extra}}


async def test_reasoning_content_apart_from_the_answer(think_server: Server) -> None:
    client = _client(think_server)
    reply = await client.chat.completions.create(**_request(think_server, REPLY))
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] in ("Hmm, yes.", "Hmm, no.")
    assert message.content in ("The answer is yes.", "The answer is no.")

    stream = await client.chat.completions.create(stream=True, **_request(think_server, REPLY))
    reasoning, content = "", ""
    async for chunk in stream:
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (message.model_extra["reasoning_content"], message.content)


async def test_enable_thinking_false_gives_only_content(think_server: Server) -> None:
    regex = r"The answer is (yes|no)\."
    reply = await _client(think_server).chat.completions.create(
        **_request(think_server, regex, chat_template_kwargs={"enable_thinking": False}))
    message = reply.choices[0].message
    assert message.content in ("The answer is yes.", "The answer is no.")
    assert "reasoning_content" not in (message.model_extra or {})


async def test_thinking_budget_forces_the_end_of_reasoning(think_server: Server) -> None:
    end = think_server.services.generation.think.end_token_ids
    budget = 6
    async with ws_connect(think_server) as ws:
        await send(ws, type="generate", id="t", messages=MESSAGES,
                   params={"max_tokens": budget + len(end) + 4, "temperature": 0.0, "ignore_eos": True,
                           "thinking_token_budget": budget})
        result = (await gather_until_done(ws, {"t"}))["t"]
    ids = result.token_ids
    assert ids[budget:budget + len(end)] == end and end[0] not in ids[:budget], ids
    reply = await _client(think_server).chat.completions.create(
        model=think_server.services.model_name, messages=MESSAGES, max_tokens=budget + len(end) + 4,
        temperature=0.0, extra_body={"thinking_token_budget": budget, "ignore_eos": True})
    reasoning = reply.choices[0].message.model_extra["reasoning_content"]
    assert reasoning == result.text.split("</think>")[0]  # (greedy: the same tokens as over the socket)


async def test_thinking_budget_on_a_model_without_reasoning_is_refused(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        answer = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "thinking_token_budget": 4})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "thinking_token_budget", answer.text


async def test_responses_give_a_reasoning_item(think_server: Server) -> None:
    """The reply starts inside `<think>` (the template opened it) and never closes it in 8 tokens: all of it
    is the `reasoning` item's text, streamed as `response.reasoning_text.delta`; greedy, so the same text as
    `/v1/stream` gives."""
    async with ws_connect(think_server) as ws:
        await send(ws, type="generate", id="r", messages=MESSAGES, params={"max_tokens": 8, "temperature": 0.0})
        text = (await gather_until_done(ws, {"r"}))["r"].text
    assert "</think>" not in text
    client = _client(think_server)
    reply = await client.responses.create(model=think_server.services.model_name, input=MESSAGES[0]["content"],
                                          max_output_tokens=8, temperature=0.0)
    (item,) = reply.output
    assert item.type == "reasoning" and [c.text for c in item.content] == [text] and item.summary == []
    events = [e async for e in await client.responses.create(
        model=think_server.services.model_name, input=MESSAGES[0]["content"], max_output_tokens=8,
        temperature=0.0, stream=True)]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))
