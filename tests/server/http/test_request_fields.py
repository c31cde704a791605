"""vLLM's and OpenAI's request fields that used to vanish or be refused, against the real server and the
default model: `guided_*` constrain the output, `logit_bias` moves the greedy choice, `/v1/completions`
batches prompts (prompt-major choices equal to single requests) and echoes them, the chat template's options
(`continue_final_message`, `add_generation_prompt`, `chat_template_kwargs`) reach it, `developer` becomes
`system` for a template without it, and every ignored field is counted."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError

from tests.server.util import Server

GREEDY = {"temperature": 0.0}


def _client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=300)


def _first_token(server: Server, text: str) -> int:
    ids = server.services.engine.tokenizer(text, add_special_tokens=False).input_ids
    return int(ids[0])


async def test_guided_json_constrains_the_chat_reply(server: Server) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
    reply = await _client(server).chat.completions.create(
        model=server.services.model_name, messages=[{"role": "user", "content": "Name a city."}],
        max_tokens=40, extra_body={"guided_json": schema}, **GREEDY)
    assert list(json.loads(reply.choices[0].message.content)) == ["city"]


async def test_guided_choice_and_two_ways_are_refused_naming_the_second(server: Server) -> None:
    client = _client(server)
    reply = await client.completions.create(
        model=server.services.model_name, prompt="The answer is", max_tokens=8,
        extra_body={"guided_choice": ["yes", "no"]}, **GREEDY)
    assert reply.choices[0].text in ("yes", "no")
    with pytest.raises(BadRequestError) as caught:
        await client.completions.create(
            model=server.services.model_name, prompt="x", max_tokens=2,
            extra_body={"guided_regex": "a+", "response_format": {"type": "json_object"}})
    assert caught.value.body["param"] == "guided_regex"


async def test_logit_bias_moves_and_forces_the_greedy_token(server: Server) -> None:
    client, model, prompt = _client(server), server.services.model_name, "The capital of France is"
    plain = await client.completions.create(model=model, prompt=prompt, max_tokens=1, **GREEDY)
    greedy = _first_token(server, plain.choices[0].text)
    banned = await client.completions.create(model=model, prompt=prompt, max_tokens=1,
                                             logit_bias={str(greedy): -100}, **GREEDY)
    assert banned.choices[0].text != plain.choices[0].text
    forced_id = _first_token(server, " banana")
    forced = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logit_bias={str(forced_id): 100}, **GREEDY)
    expected = server.services.engine.tokenizer.decode([forced_id] * 3)
    assert forced.choices[0].message.content == expected


@pytest.mark.parametrize("bias, needle", [({"49152": 1}, "not in [0, 49152)"), ({"5": 101}, "[-100, 100]"),
                                          ({"x": 1}, "token ids"), ([1], "object")])
async def test_bad_logit_bias_is_refused_naming_it(server: Server, bias: Any, needle: str) -> None:
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        answer = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": bias})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "logit_bias" and needle in error["message"], error


async def test_batched_prompts_give_prompt_major_choices_equal_to_single_requests(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    ids = server.services.engine.tokenizer("Once upon a time", add_special_tokens=False).input_ids
    prompts: list[Any] = ["The sky is", "My favourite food is", ids]
    singles = [(await client.completions.create(model=model, prompt=p, max_tokens=6, **GREEDY)).choices[0].text
               for p in prompts]
    batch = await client.completions.create(model=model, prompt=prompts, max_tokens=6, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices] == [t for t in singles for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(
        len(server.services.engine.tokenizer(p).input_ids) if isinstance(p, str) else len(p) for p in prompts)
    texts: dict[int, str] = {}
    stream = await client.completions.create(model=model, prompt=prompts, max_tokens=6, stream=True,
                                             stream_options={"include_usage": True}, **GREEDY)
    usage = None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == singles
    assert usage is not None and usage.completion_tokens == 18


async def test_echo_puts_the_prompt_before_the_text(server: Server) -> None:
    client, model, prompt = _client(server), server.services.model_name, "The sky is"
    plain = await client.completions.create(model=model, prompt=prompt, max_tokens=4, **GREEDY)
    echoed = await client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=4, echo=True, stream=True,
                                             **GREEDY)
    assert "".join([c.choices[0].text async for c in stream]) == prompt + plain.choices[0].text


async def test_continue_final_message_and_template_kwargs_reach_the_template(server: Server) -> None:
    client, model = _client(server), server.services.model_name
    messages = [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi there, I"}]
    expected = server.services.engine.tokenizer.apply_chat_template(messages, continue_final_message=True)["input_ids"]
    reply = await client.chat.completions.create(
        model=model, messages=messages, max_tokens=2,
        extra_body={"continue_final_message": True, "add_generation_prompt": False}, **GREEDY)
    assert reply.usage.prompt_tokens == len(expected)
    with pytest.raises(BadRequestError) as caught:  # a template of the request's own is never taken
        await client.chat.completions.create(model=model, messages=messages[:1], max_tokens=2,
                                             extra_body={"chat_template_kwargs": {"chat_template": "{{ 1 }}"}})
    assert caught.value.body["param"] == "chat_template_kwargs"
    harmless = await client.chat.completions.create(model=model, messages=messages[:1], max_tokens=2,
                                                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert harmless.usage.prompt_tokens > 0


async def test_developer_is_system_for_a_template_without_it(server: Server) -> None:
    assert "developer" not in server.services.engine.tokenizer.chat_template
    client, model = _client(server), server.services.model_name
    usage = []
    for role in ("developer", "system"):
        reply = await client.chat.completions.create(
            model=model, max_tokens=1, messages=[{"role": role, "content": "Be brief."},
                                                 {"role": "user", "content": "hi"}])
        usage.append(reply.usage.prompt_tokens)
    tokenizer = server.services.engine.tokenizer
    dropped = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)["input_ids"]
    assert usage[0] == usage[1] != len(dropped)


async def test_ignored_fields_are_counted(server: Server) -> None:
    def count(text: str, route: str, name: str) -> float:
        line = f'streamd_ignored_request_fields_total{{field="{name}",route="{route}"}}'
        values = [float(row.split()[-1]) for row in text.splitlines() if row.startswith(line)]
        return values[0] if values else 0.0

    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        before = (await http.get("/metrics")).text
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "user": "u1",
                "some_new_field": 1, "another_one": True}
        assert (await http.post("/v1/chat/completions", json=body)).status_code == 200
        after = (await http.get("/metrics")).text
    assert count(after, "chat", "user") == count(before, "chat", "user") + 1
    assert count(after, "chat", "other") == count(before, "chat", "other") + 2
