"""Issue 10's hardening on the routes added after it: `POST /v1/responses`, WebSocket `/v1/responses` and
chat completions with tools. Unencodable text, deep nesting, non-finite numbers and inputs over the limits
get a clear error (the socket kept); a good response on the same socket afterwards has the reference text;
responses cancelled before admission are counted; the pool is whole afterwards (fixture)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from tests.reliability.test_reproductions import error_for
from tests.reliability.util import LIMITS, settle
from tests.server.util import Server, gather_until_done, send, ws_connect

QUESTION = "What is the capital of France?"
TOKENS = 8
CHARS = LIMITS["max_prompt_chars"]
# (raw event, expected error code, the stream_id its error must carry (None: unreadable), message part)
BAD_EVENTS: list[tuple[str, str, str | None, str]] = [
    ('{"type":"response.create","stream_id":"s1","input":"Hi \\ud800"}', "invalid_json", None,
     "cannot be encoded as UTF-8"),
    ("[" * 3000 + "]" * 3000, "invalid_json", None, "nested too deeply"),
    ('{"type":"response.create","stream_id":"s2","input":"Hi","temperature":-Infinity}', "invalid_request", "s2",
     "temperature"),
    ('{"type":"response.create","stream_id":"s3","input":"Hi","top_p":1e300}', "invalid_request", "s3", "top_p"),
    (json.dumps({"type": "response.create", "stream_id": "s4", "input": "y" * (CHARS + 1)}), "request_too_large",
     "s4", "max_prompt_chars"),
    (json.dumps({"type": "response.create", "stream_id": "s5", "input": "Hi", "instructions": "z" * CHARS}),
     "request_too_large", "s5", "max_prompt_chars"),
]


def responses_url(server: Server) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/responses"


async def reference_text(server: Server) -> str:
    """The greedy answer over streamd.v1 (an independent route into the same engine)."""
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="ref", messages=[{"role": "user", "content": QUESTION}],
                   params={"max_tokens": TOKENS, "temperature": 0})
        return (await gather_until_done(ws, {"ref"}))["ref"].text


async def events_until_done(ws: ClientConnection) -> list[dict[str, Any]]:
    events = [json.loads(await asyncio.wait_for(ws.recv(), 120))]
    while events[-1]["type"] not in ("response.completed", "response.incomplete", "error"):
        events.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
    return events


async def test_responses_websocket_refuses_bad_events_and_keeps_the_socket(rserver: Server) -> None:
    expected = await reference_text(rserver)
    async with connect(responses_url(rserver)) as ws:
        for raw, *_ in BAD_EVENTS:
            await ws.send(raw)
        errors = [json.loads(await asyncio.wait_for(ws.recv(), 120)) for _ in BAD_EVENTS]
        assert all(e["type"] == "error" for e in errors), errors
        got = sorted((e["error"]["code"], e.get("stream_id") or "") for e in errors)
        assert got == sorted((code, lane or "") for _, code, lane, _ in BAD_EVENTS)
        for _, code, lane, part in BAD_EVENTS:
            assert any(e["error"]["code"] == code and e.get("stream_id") == lane and part in e["error"]["message"]
                       for e in errors), (code, lane, errors)
        await ws.send(json.dumps({"type": "response.create", "input": QUESTION, "max_output_tokens": TOKENS,
                                  "temperature": 0}))
        events = await events_until_done(ws)
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == expected


async def test_responses_http_limits(rserver: Server) -> None:
    async with httpx.AsyncClient(base_url=rserver.http, timeout=120) as http:
        async def post(content: bytes, content_type: str = "application/json") -> httpx.Response:
            return await http.post("/v1/responses", content=content, headers={"Content-Type": content_type})

        answer = await post(json.dumps({"input": "Hi \ud800"}).encode())
        assert answer.status_code == 400 and "cannot be encoded as UTF-8" in answer.json()["error"]["message"]
        answer = await post(b'{"input":' + b"[" * 3000 + b"]" * 3000 + b"}")
        assert answer.status_code == 400 and "nested too deeply" in answer.json()["error"]["message"]
        answer = await post(json.dumps({"input": "y" * (CHARS + 1)}).encode())
        assert answer.status_code == 413 and answer.json()["error"]["param"] == "input"
        answer = await post(json.dumps({"input": "y" * LIMITS["max_body_bytes"]}).encode())
        assert answer.status_code == 413 and "max_body_bytes" in answer.json()["error"]["message"]
        answer = await post(b'{"input":"Hi"}', "text/plain")
        assert answer.status_code == 415
        answer = await post(b'{"input":"Hi","temperature":Infinity}')
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "temperature", answer.text


WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


async def test_chat_with_tools_limits(rserver: Server) -> None:
    def chat(arguments: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "Weather?"},
                             {"role": "assistant", "content": None, "tool_calls": [{
                                 "id": "c1", "type": "function",
                                 "function": {"name": "weather", "arguments": arguments}}]},
                             {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
                "tools": tools, "max_tokens": 2}

    long_tool = {**WEATHER, "function": {**WEATHER["function"], "description": "d" * CHARS}}
    async with httpx.AsyncClient(base_url=rserver.http, timeout=120) as http:
        answer = await http.post("/v1/chat/completions", json=chat('{"city": "Paris"}', [long_tool]))
        assert answer.status_code == 413 and answer.json()["error"]["param"] == "messages", answer.text
        for arguments, part in (('{"city": "\\ud800"}', "cannot be encoded as UTF-8"),
                                ('{"a":' * 3000 + "1" + "}" * 3000, "nested too deeply")):
            answer = await http.post("/v1/chat/completions", json=chat(arguments, [WEATHER]))
            assert answer.status_code == 400, answer.text
            assert "tool_calls" in answer.json()["error"]["message"] and part in answer.json()["error"]["message"]
        answer = await http.post("/v1/chat/completions", json=chat('{"city": "Paris"}', [WEATHER]))
        assert answer.status_code == 200, answer.text


async def test_responses_cancelled_before_admission_are_counted(rserver: Server) -> None:
    """Seven responses on one lane (one runs, six wait for it), then the socket is gone: all seven counted."""
    def total() -> float:
        return sum(s.value for m in rserver.services.metrics.requests.collect() for s in m.samples
                   if s.name.endswith("_total"))

    before = total()
    async with connect(responses_url(rserver)) as ws:
        for _ in range(7):
            await ws.send(json.dumps({"type": "response.create", "input": "Tell me a story", "stream_id": "L",
                                      "max_output_tokens": 200}))
        await ws.send('{"type": "nope"}')  # answered at once: the server has read the seven before it
        while json.loads(await asyncio.wait_for(ws.recv(), 120))["type"] != "error":
            pass
        ws.transport.abort()
    await settle(rserver)
    await rserver.services.engine.wait_idle(timeout=120)
    assert total() - before == 7


async def test_deep_schemas_are_refused_before_compiling(rserver: Server) -> None:
    """A schema nested 300 objects deep would keep a compile thread busy for many seconds per request."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    async with httpx.AsyncClient(base_url=rserver.http, timeout=120) as http:
        answer = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}})
        assert answer.status_code == 400 and "nested too deeply" in answer.json()["error"]["message"], answer.text
    async with ws_connect(rserver) as ws:
        error = await error_for(ws, json.dumps({"type": "generate", "id": "deep", "prompt": "Hi",
                                                "params": {"structured_outputs": {"json": schema}}}))
        assert error["id"] == "deep" and "nested too deeply" in error["error"]["message"], error
