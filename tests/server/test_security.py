"""API keys (HTTP Bearer, WebSocket header or `bearer.<key>` subprotocol; STREAMD_API_KEY), the Origin
allowlist (CORS on HTTP: preflights answered before the key check) and the connection limit (503 with
Retry-After), all refused before the WebSocket handshake completes; the chat page's Content-Security-Policy."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
import pytest_asyncio
from websockets.exceptions import InvalidStatus

from tests.server.util import Server, gather_until_done, running_server, send, ws_connect

KEYS = ["key-one", "key-two"]
GOOD_ORIGIN = "http://chat.example"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def locked(async_engine) -> AsyncIterator[Server]:
    async with running_server(async_engine, api_keys=KEYS, allowed_origins=[GOOD_ORIGIN]) as srv:
        yield srv


async def test_http_routes_need_a_key_except_health_ready_and_page(locked: Server) -> None:
    async with httpx.AsyncClient(base_url=locked.http) as http:
        for path in ("/health", "/ready", "/"):
            assert (await http.get(path)).status_code == 200, path
        for path in ("/v1/models", "/metrics"):
            missing = await http.get(path)
            wrong = await http.get(path, headers={"Authorization": "Bearer nope"})
            right = await http.get(path, headers={"Authorization": f"Bearer {KEYS[1]}"})
            assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200), path
            assert missing.json()["error"]["type"] == "authentication_error"
        post = await http.post("/v1/completions", json={"prompt": "x"})
        assert post.status_code == 401


async def test_openai_client_with_and_without_key(locked: Server) -> None:
    bad = openai.AsyncOpenAI(base_url=f"{locked.http}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    good = openai.AsyncOpenAI(base_url=f"{locked.http}/v1", api_key=KEYS[0], max_retries=0)
    assert len((await good.models.list()).data) == 1


async def test_websocket_key_by_header_or_subprotocol(locked: Server) -> None:
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(locked):
            pass
    assert info.value.response.status_code == 401
    with pytest.raises(InvalidStatus):
        async with ws_connect(locked, subprotocols=["streamd.v1", "bearer.nope"]):
            pass
    async with ws_connect(locked, additional_headers={"Authorization": f"Bearer {KEYS[0]}"}) as ws:
        await send(ws, type="generate", id="h", prompt="Hi", params={"max_tokens": 2})
        assert (await gather_until_done(ws, {"h"}))["h"].done["finish_reason"] in ("stop", "length")
    async with ws_connect(locked, subprotocols=["streamd.v1", f"bearer.{KEYS[1]}"]) as ws:
        assert ws.subprotocol == "streamd.v1"  # the key is never echoed back
        await send(ws, type="generate", id="s", prompt="Hi", params={"max_tokens": 2})
        await gather_until_done(ws, {"s"})


async def test_origin_allowlist(locked: Server) -> None:
    auth = {"subprotocols": ["streamd.v1", f"bearer.{KEYS[0]}"]}
    with pytest.raises(InvalidStatus) as info:
        async with ws_connect(locked, origin="http://evil.example", **auth):
            pass
    assert info.value.response.status_code == 403
    async with ws_connect(locked, origin=GOOD_ORIGIN, **auth) as ws:
        assert ws.subprotocol == "streamd.v1"


async def test_connection_limit(async_engine) -> None:
    async with running_server(async_engine, max_connections=2) as srv, \
            ws_connect(srv) as first, ws_connect(srv) as second:
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(srv):
                pass
        assert info.value.response.status_code == 503
        assert info.value.response.headers["Retry-After"] == "1"  # the OpenAI SDKs wait that long, then retry
        assert first.subprotocol == second.subprotocol == "streamd.v1"


PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}


async def test_cors_preflight_from_an_allowed_origin_passes_with_keys_on(locked: Server) -> None:
    async with httpx.AsyncClient(base_url=locked.http) as http:
        allowed = await http.options("/v1/chat/completions", headers={"Origin": GOOD_ORIGIN, **PREFLIGHT})
        assert allowed.status_code == 200, allowed.text
        assert allowed.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN
        assert "POST" in allowed.headers["Access-Control-Allow-Methods"]
        assert "authorization" in allowed.headers["Access-Control-Allow-Headers"].lower()
        # The answers themselves name the origin, a 401 too (so the page can read why).
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        refused = await http.post("/v1/chat/completions", json=body, headers={"Origin": GOOD_ORIGIN})
        served = await http.post("/v1/chat/completions", json=body,
                                 headers={"Origin": GOOD_ORIGIN, "Authorization": f"Bearer {KEYS[0]}"})
        assert (refused.status_code, served.status_code) == (401, 200)
        assert refused.headers["Access-Control-Allow-Origin"] == served.headers["Access-Control-Allow-Origin"] == GOOD_ORIGIN


async def test_cors_gives_a_disallowed_origin_nothing(locked: Server) -> None:
    evil = {"Origin": "http://evil.example"}
    async with httpx.AsyncClient(base_url=locked.http) as http:
        preflight = await http.options("/v1/chat/completions", headers={**evil, **PREFLIGHT})
        models = await http.get("/v1/models", headers={**evil, "Authorization": f"Bearer {KEYS[0]}"})
        post = await http.post("/v1/completions", json={"prompt": "x"},
                               headers={**evil, "Authorization": f"Bearer {KEYS[0]}"})
    assert preflight.status_code == 400 and models.status_code == 200 and post.status_code == 403
    for answer in (preflight, models, post):
        assert "Access-Control-Allow-Origin" not in answer.headers


async def test_cors_any_origin(async_engine) -> None:
    async with running_server(async_engine, allowed_origins=["*"]) as srv, \
            httpx.AsyncClient(base_url=srv.http) as http:
        preflight = await http.options("/v1/models", headers={"Origin": "https://anywhere.example",
                                                              "Access-Control-Request-Method": "GET"})
        assert preflight.status_code == 200
        assert preflight.headers["Access-Control-Allow-Origin"] == "https://anywhere.example"


async def test_streamd_api_key_protects_the_server(async_engine) -> None:
    async with running_server(async_engine, environ={"STREAMD_API_KEY": "from-env"}) as srv:
        anonymous = openai.AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await anonymous.models.list()
        keyed = openai.AsyncOpenAI(base_url=f"{srv.http}/v1", api_key="from-env", max_retries=0)
        assert [m.id for m in (await keyed.models.list()).data] == [srv.services.model_name]
        with pytest.raises(InvalidStatus) as info:
            async with ws_connect(srv):
                pass
        assert info.value.response.status_code == 401
async def test_chat_page_policy_allows_no_inline_script_or_style(locked: Server) -> None:
    # The page is files only; tests/server/test_chat_page.py runs it in Chromium under this very header.
    async with httpx.AsyncClient(base_url=locked.http) as http:
        policy = (await http.get("/")).headers["content-security-policy"]
    directives = {name: sources for name, *sources in (part.split() for part in policy.split(";"))}
    assert directives["default-src"] == ["'none'"]
    assert directives["script-src"] == directives["style-src"] == ["'self'"]
