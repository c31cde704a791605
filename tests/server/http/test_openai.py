"""OpenAI-compatible HTTP with the official `openai` client: streaming equals the WebSocket, errors are
OpenAI error bodies with the right status, a disconnect aborts the request."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from streamd.server.errors import ServiceError
from tests.server.util import Server, gather_until_done, send, ws_connect

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


async def test_models_lists_the_served_model(client: AsyncOpenAI, server: Server) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [server.services.model_name]


async def test_streamed_chat_equals_the_websocket(client: AsyncOpenAI, server: Server) -> None:
    params = {"max_tokens": 16, "temperature": 0.0}
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="w", messages=MESSAGES, params=params)
        via_ws = (await gather_until_done(ws, {"w"}))["w"]
    stream = await client.chat.completions.create(model=server.services.model_name, messages=MESSAGES,
                                                  stream=True, stream_options={"include_usage": True}, **params)
    pieces, finish, usage, roles = [], None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        (choice,) = chunk.choices
        assert chunk.object == "chat.completion.chunk" and chunk.id.startswith("chatcmpl-")
        roles.append(choice.delta.role)
        pieces.append(choice.delta.content or "")
        finish = choice.finish_reason or finish
    assert roles[0] == "assistant"
    assert "".join(pieces) == via_ws.text
    assert finish == via_ws.done["finish_reason"]
    assert usage is not None and usage.completion_tokens == via_ws.done["usage"]["completion_tokens"]
    assert usage.prompt_tokens == via_ws.done["usage"]["prompt_tokens"]


async def test_plain_chat_and_completions(client: AsyncOpenAI, server: Server) -> None:
    chat = await client.chat.completions.create(model=server.services.model_name, messages=MESSAGES,
                                                max_tokens=8, temperature=0)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert chat.usage.completion_tokens >= 1
    completion = await client.completions.create(model=server.services.model_name, prompt="1, 2, 3,",
                                                 temperature=0)
    assert completion.object == "text_completion"
    assert completion.usage.completion_tokens == 16  # OpenAI's default max_tokens for completions
    assert completion.choices[0].finish_reason == "length"
    streamed = await client.completions.create(model=server.services.model_name, prompt="1, 2, 3,",
                                               temperature=0, stream=True)
    assert "".join([c.choices[0].text async for c in streamed]) == completion.choices[0].text


@pytest.mark.parametrize("extra, status, code", [
    ({"temperature": -1}, 400, "invalid_request"),
    ({"top_p": 0}, 400, "invalid_request"),
    ({"max_tokens": 10 ** 7}, 400, "context_length_exceeded"),
    ({"n": 17}, 400, "invalid_request"),
    ({"functions": [{"name": "f"}]}, 400, "unsupported"),
    ({"model": "gpt-nonexistent"}, 404, "model_not_found"),
])
async def test_bad_parameters_give_openai_errors(client: AsyncOpenAI, server: Server, extra: dict,
                                                 status: int, code: str) -> None:
    body = {"model": server.services.model_name, "messages": MESSAGES, "max_tokens": 4, **extra}
    with pytest.raises(openai.APIStatusError) as info:
        await client.chat.completions.create(**body)
    assert info.value.status_code == status
    error = info.value.response.json()["error"]
    assert error["code"] == code and error["message"]
    assert error["type"] == ServiceError(code, "").type


async def test_malformed_bodies(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.http) as http:
        bad_json = await http.post("/v1/chat/completions", content=b"{nope")
        not_object = await http.post("/v1/completions", json=[{"prompt": "Hi"}])
        no_messages = await http.post("/v1/chat/completions", json={"model": server.services.model_name})
        too_long = await http.post("/v1/completions", json={"prompt": [7] * 100_000})
        stream_zero = await http.post("/v1/completions", json={"prompt": "Hi", "stream": 0})
        bad_options = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                   "stream": True, "stream_options": "usage"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["code"] == "invalid_json"
    assert not_object.status_code == 400 and not_object.json()["error"]["code"] == "invalid_request"
    assert "must be a JSON object" in not_object.json()["error"]["message"]
    assert no_messages.status_code == 400 and no_messages.json()["error"]["param"] == "messages"
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    for response, param in ((stream_zero, "stream"), (bad_options, "stream_options")):
        error = response.json()["error"]
        assert response.status_code == 400 and error["code"] == "invalid_request", error
        assert error["param"] == param and error["message"].startswith(param + " must be "), error


async def test_disconnect_aborts_the_request(server: Server, async_engine) -> None:
    cancelled = server.services.metrics.requests.labels("cancelled")
    before = cancelled._value.get()
    body = {"messages": MESSAGES, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=server.http, timeout=120) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # a real token arrived: now hang up
    stats = await async_engine.wait_idle(timeout=60)
    assert stats.kv.blocks_free == stats.kv.blocks_total
    assert cancelled._value.get() == before + 1


async def test_non_streaming_disconnect_aborts_too(server: Server, async_engine) -> None:
    cancelled = server.services.metrics.requests.labels("cancelled")
    before = cancelled._value.get()
    body = {"prompt": "Once", "max_tokens": 3000, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=server.http, timeout=httpx.Timeout(120, read=2.0)) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)
    await async_engine.wait_idle(timeout=60)
    assert cancelled._value.get() == before + 1


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("usage", ["none", "final", "continuous"])
def test_text_events_are_the_chunks_encoded_whole(kind: str, usage: str) -> None:
    """The pre-split SSE chunk gives, for any text (and, with continuous usage, any usage as of the delta),
    the bytes of the chunk built and encoded whole."""
    from streamd.server.http.openai_routes import TextEvents, _Call, _chunk, _data, _piece

    prepared = SimpleNamespace(service_tier="default")
    call = _Call(kind, "cmpl-x\"y", "model \u00e9", 1700000000, prepared, None, None)  # type: ignore[arg-type]
    extra: dict = {} if usage == "none" else {"usage": None}
    events = TextEvents(call, extra, continuous=usage == "continuous")
    usages = [{"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n} for n in range(1, 4)]
    usages.append({**usages[-1], "prompt_tokens_details": {"cached_tokens": 4},
                   "completion_tokens_details": {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 1}})
    texts = ["Hello", " world", "\"quoted\" \\ back", "line\nbreak\ttab", "\u00fc\u65e5\U0001f600", "\x00",
             TextEvents.HOLE, TextEvents.USAGE_HOLE, "{}", "\ud800"]
    for index in (0, 3):
        for step, text in enumerate(texts):
            if usage == "continuous":
                extra["usage"] = usages[step % len(usages)]
            assert events.event(index, text) == _data(_chunk(call, index, _piece(call, text), None, extra)).encode()
