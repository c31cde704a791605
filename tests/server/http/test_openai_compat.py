"""OpenAI compatibility through the official `openai` client (async, sync, streamed and not) and raw httpx:
logprobs on both routes equal the WebSocket's, JSON error bodies for every status the server produces,
the drain's finish reason, vLLM's /tokenize and /detokenize, and WebSocket error frames naming client ids."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.routing import Route

from tests.helpers import hf_logprobs
from tests.server.util import Server, gather_until_done, recv, running_server, send, ws_connect

MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The three primary colours are"
TOKENS = 8
TOP = 3


@pytest.fixture
def client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


async def ws_logprobs(server: Server, params: dict[str, Any], **source: Any) -> tuple[list[int], list[dict]]:
    """The WebSocket's token ids and per-token {token id: logprob} dicts for one request, run twice so that
    its prompt's full blocks are in the prefix cache, as they are for the HTTP requests that follow (a cached
    prefix changes how the rest of the prompt is computed, and so the last bits of the floats)."""
    async with ws_connect(server) as ws:
        for _ in range(2):
            await send(ws, type="generate", id="ref", params={**params, "logprobs": TOP}, **source)
            result = (await gather_until_done(ws, {"ref"}))["ref"]
    logprobs = [{int(t): lp for t, lp in d.items()} for f in result.of("delta") for d in f["logprobs"]]
    assert len(logprobs) == len(result.token_ids) == TOKENS
    return result.token_ids, logprobs


def expected_chat(tokenizer: Any, ids: list[int], logprobs: list[dict[int, float]]) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs for these WebSocket results (texts from the tokenizer itself)."""
    text = lambda t: tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    return [{"token": text(t), "logprob": d[t],
             "top_logprobs": [{"token": text(k), "logprob": v} for k, v in list(d.items())[:TOP]]}
            for t, d in zip(ids, logprobs)]


def without_bytes(entries: list[Any]) -> list[dict[str, Any]]:
    return [{"token": e.token, "logprob": e.logprob,
             "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in e.top_logprobs]} for e in entries]


async def test_chat_logprobs_equal_the_websocket(client: AsyncOpenAI, server: Server, smol_llm) -> None:
    params = {"max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True}
    ids, logprobs = await ws_logprobs(server, params, messages=MESSAGES)
    expected = expected_chat(smol_llm.tokenizer, ids, logprobs)
    body = {"model": server.services.model_name, "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0.0,
            "logprobs": True, "top_logprobs": TOP, "extra_body": {"ignore_eos": True}}
    whole = await client.chat.completions.create(**body)
    content = whole.choices[0].logprobs.content
    assert without_bytes(content) == expected
    # bytes are each token's exact bytes: joined, they are the reply's text
    assert b"".join(bytes(e.bytes) for e in content) == whole.choices[0].message.content.encode()
    streamed = [c async for c in await client.chat.completions.create(**body, stream=True)]
    assert streamed[0].choices[0].delta.role == "assistant" and streamed[0].choices[0].logprobs is None
    pieces = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert without_bytes(pieces) == expected
    assert [e.bytes for e in pieces] == [e.bytes for e in content]
    sync = OpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)
    again = await asyncio.to_thread(sync.chat.completions.create, **body)
    assert without_bytes(again.choices[0].logprobs.content) == expected


async def test_completion_logprobs_equal_the_websocket(client: AsyncOpenAI, server: Server, smol_llm,
                                                       hf_smol) -> None:
    params = {"max_tokens": TOKENS, "temperature": 0.9, "seed": 1234, "ignore_eos": True}
    ids, logprobs = await ws_logprobs(server, params, prompt=PROMPT)
    # The WebSocket's are the model's raw logprobs (transformers' on the same weights; not temperature-scaled):
    # the top N by value, and the sampled token.
    rows = hf_logprobs(hf_smol, smol_llm.tokenizer(PROMPT).input_ids, ids)
    for step, (token, d, row) in enumerate(zip(ids, logprobs, rows)):
        top = row.topk(TOP).indices.tolist()
        assert set(d) == {*top, token} and list(d)[:TOP] == top, step
        assert d == pytest.approx({t: row[t].item() for t in d}, abs=2e-3), step
    text = lambda t: smol_llm.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    body = {"model": server.services.model_name, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0.9,
            "seed": 1234, "logprobs": TOP, "extra_body": {"ignore_eos": True}}
    whole = await client.completions.create(**body)
    got = whole.choices[0].logprobs
    assert got.tokens == [text(t) for t in ids]
    assert got.token_logprobs == [d[t] for t, d in zip(ids, logprobs)]
    # the top N and the sampled token (OpenAI: up to logprobs + 1 entries), in the same order
    assert [list(d.items()) for d in got.top_logprobs] == [[(text(k), v) for k, v in d.items()] for d in logprobs]
    assert got.text_offset == [sum(len(s) for s in got.tokens[:i]) for i in range(len(ids))]
    assert "".join(got.tokens) == whole.choices[0].text
    streamed = [c async for c in await client.completions.create(**body, stream=True)]
    parts = [c.choices[0].logprobs for c in streamed if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == got.tokens
    assert [o for p in parts for o in p.text_offset] == got.text_offset
    assert [lp for p in parts for lp in p.token_logprobs] == got.token_logprobs
    samples = await client.completions.create(**{**body, "n": 2, "max_tokens": 4})  # each choice its own
    for choice in samples.choices:
        assert len(choice.logprobs.tokens) == 4 and "".join(choice.logprobs.tokens) == choice.text


@pytest.mark.parametrize("route, extra, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completion", {"logprobs": 21}, "logprobs"),
    ("completion", {"logprobs": True}, "logprobs"),
])
async def test_logprobs_out_of_bounds_are_refused(client: AsyncOpenAI, server: Server, route: str,
                                                  extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            await client.chat.completions.create(model=server.services.model_name, messages=MESSAGES,
                                                 max_tokens=2, extra_body=extra)
        else:
            await client.completions.create(model=server.services.model_name, prompt=PROMPT, max_tokens=2,
                                            extra_body=extra)
    error = info.value.response.json()["error"]
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


def check_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and set(error) == {"message", "type", "param", "code"}
    return error


async def test_unknown_routes_and_methods_get_json_errors(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.http) as http:
        error = check_error(await http.get("/v1/nope"), 404, "not_found")
        assert "/v1/nope" in error["message"]
        wrong = await http.get("/v1/chat/completions")
        check_error(wrong, 405, "method_not_allowed")
        assert wrong.headers["allow"] == "POST"
        check_error(await http.delete("/v1/models"), 405, "method_not_allowed")
    with pytest.raises(openai.NotFoundError) as info:  # as the client sees it
        await AsyncOpenAI(base_url=f"{server.http}/v2", api_key="unused", max_retries=0).models.list()
    assert info.value.body["code"] == "not_found"


@pytest.mark.parametrize("status, code", [(413, "request_too_large"), (415, "unsupported_media_type"),
                                          (422, "unprocessable_entity"), (429, "too_many_requests"),
                                          (503, "service_unavailable")])
async def test_any_http_exception_gets_a_json_body(async_engine, status: int, code: str) -> None:
    """What a guard raises (as HTTPException) comes out as an OpenAI error body with its status; anything
    unexpected is a JSON 500."""
    async def refuse(request: Request) -> None:
        raise HTTPException(status, "refused by a guard")

    async def crash(request: Request) -> None:
        raise RuntimeError("bug")

    async with running_server(async_engine) as srv:
        srv.app.router.routes.extend([Route("/refuse", refuse), Route("/crash", crash)])
        async with httpx.AsyncClient(base_url=srv.http) as http:
            refused = await http.get("/refuse")
            error = check_error(refused, status, code)
            assert "refused by a guard" in error["message"]
            assert refused.headers.get("Retry-After") == ("1" if status == 503 else None)  # the SDKs wait, retry
            crashed = check_error(await http.get("/crash"), 500, "internal_error")
    assert crashed["type"] == "server_error" and "bug" not in crashed["message"]


async def test_drain_cuts_streams_with_length_and_a_flag(async_engine) -> None:
    """A stream the drain cuts ends "length" with `streamd_drained: true` (streamed and whole), the
    WebSocket's with "cancelled"; refusals while draining are 503 JSON bodies."""
    async with running_server(async_engine, drain_timeout_s=0.0) as srv:
        client = AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0, timeout=120)
        body = {"model": srv.services.model_name, "messages": MESSAGES, "max_tokens": 4000,
                "extra_body": {"ignore_eos": True}}
        stream = await client.chat.completions.create(**body, stream=True)
        chunks = [await anext(stream)]
        while not chunks[-1].choices[0].delta.content:  # a real token arrived: the request runs
            chunks.append(await anext(stream))
        whole = asyncio.create_task(client.completions.create(model=srv.services.model_name, prompt=PROMPT,
                                                              max_tokens=4000, extra_body={"ignore_eos": True}))
        async with ws_connect(srv) as ws:
            await send(ws, type="generate", id="w", prompt=PROMPT, params={"max_tokens": 4000, "ignore_eos": True})
            assert (await recv(ws))["type"] == "start"
            while srv.services.lifecycle.num_active < 3:  # the completion is admitted too
                assert (await recv(ws))["type"] == "delta"
            drain = asyncio.create_task(srv.services.lifecycle.drain())
            frames = (await gather_until_done(ws, {"w"}))["w"]
        chunks += [c async for c in stream]
        await drain
        async with httpx.AsyncClient(base_url=srv.http) as http:
            check_error(await http.post("/v1/completions", json={"prompt": "x"}), 503, "shutting_down")
            ready = await http.get("/ready")
            assert ready.json()["status"] == "draining"
            check_error(ready, 503, "shutting_down")
    final = chunks[-1].choices[0]
    assert final.finish_reason == "length" and final.model_extra["streamd_drained"] is True
    completion = (await whole).choices[0]
    assert completion.finish_reason == "length" and completion.model_extra["streamd_drained"] is True
    assert frames.done["finish_reason"] == "cancelled"


async def test_tokenize_and_detokenize(server: Server, client: AsyncOpenAI, smol_llm) -> None:
    tokenizer = smol_llm.tokenizer
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        plain = (await http.post("/tokenize", json={"model": server.services.model_name, "prompt": PROMPT,
                                                    "return_token_strs": True})).json()
        ids = tokenizer(PROMPT).input_ids
        assert plain == {"count": len(ids), "max_model_len": server.services.engine.max_model_len, "tokens": ids,
                         "token_strs": tokenizer.convert_ids_to_tokens(ids)}
        chat = (await http.post("/tokenize", json={"messages": MESSAGES})).json()
        assert chat["tokens"] == list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=False))
        assert chat["token_strs"] is None
        open_turn = [*MESSAGES, {"role": "assistant", "content": "Red,"}]
        continued = (await http.post("/tokenize", json={"messages": open_turn, "add_generation_prompt": False,
                                                        "continue_final_message": True})).json()
        assert continued["tokens"] == list(tokenizer.apply_chat_template(
            open_turn, continue_final_message=True, tokenize=True, return_dict=False))
        special = (await http.post("/tokenize", json={"messages": MESSAGES, "add_special_tokens": True})).json()
        rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        assert special["tokens"] == tokenizer(rendered, add_special_tokens=True).input_ids
        text = (await http.post("/detokenize", json={"tokens": ids})).json()
        assert text == {"prompt": PROMPT}
        for path, bad, param in [("/tokenize", {"prompt": PROMPT, "messages": MESSAGES}, "prompt"),
                                 ("/tokenize", {"prompt": PROMPT, "add_special_tokens": "yes"}, "add_special_tokens"),
                                 ("/tokenize", {"messages": MESSAGES, "continue_final_message": True},
                                  "continue_final_message"),
                                 ("/detokenize", {"tokens": [len(tokenizer)]}, "tokens"),
                                 ("/tokenize", {"prompt": PROMPT, "model": "other"}, "model")]:
            response = await http.post(path, json=bad)
            assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, bad
    # what /tokenize counts is what a chat completion is charged
    reply = await client.chat.completions.create(model=server.services.model_name, messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]


async def test_ws_errors_name_the_client_id_and_never_an_internal_one(server: Server) -> None:
    """A duplicate id's error names the client's id; the running request with that id is unaffected; no
    frame carries an internal (32-hex) request id."""
    async with ws_connect(server) as ws:
        await send(ws, type="generate", id="same", prompt=PROMPT, params={"max_tokens": 12, "ignore_eos": True})
        messages = [await ws.recv()]
        assert json.loads(messages[0])["type"] == "start"
        await send(ws, type="generate", id="same", prompt="again", params={"max_tokens": 2})
        await send(ws, type="cancel", id="ghost")
        frames = [json.loads(messages[0])]
        while not (any(f["type"] == "done" for f in frames) and sum(f["type"] == "error" for f in frames) == 2):
            messages.append(await asyncio.wait_for(ws.recv(), 120))
            frames.append(json.loads(messages[-1]))
    errors = {f["error"]["code"]: f["id"] for f in frames if f["type"] == "error"}
    assert errors == {"duplicate_id": "same", "unknown_id": "ghost"}
    (done,) = [f for f in frames if f["type"] == "done"]
    assert done["id"] == "same" and done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 12
    assert not any(re.search(r"[0-9a-f]{32}", m) for m in messages)


def test_token_bytes_are_exact_for_split_characters(smol_llm) -> None:
    """Byte-level tokens that hold part of a character: each token's bytes are its own, so they join into
    the text (its decoded text alone is U+FFFD)."""
    from streamd.server.logprobs import TokenTexts

    text = "héllo 日本 🙂 <|im_end|>"
    ids = smol_llm.tokenizer(text).input_ids
    texts = TokenTexts(smol_llm.tokenizer)
    assert b"".join(bytes(texts.get(t).bytes) for t in ids) == text.encode()
    assert any(texts.get(t).text == "\ufffd" for t in ids)
