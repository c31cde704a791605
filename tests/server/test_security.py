"""API keys (HTTP Bearer, WebSocket header or `bearer.<key>` subprotocol), the Origin allowlist and the
connection limit, all refused before the WebSocket handshake completes; the chat page's
Content-Security-Policy."""

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
        assert first.subprotocol == second.subprotocol == "streamd.v1"


async def test_chat_page_policy_allows_no_inline_script_or_style(locked: Server) -> None:
    # The page is files only; tests/server/test_chat_page.py runs it in Chromium under this very header.
    async with httpx.AsyncClient(base_url=locked.http) as http:
        policy = (await http.get("/")).headers["content-security-policy"]
    directives = {name: sources for name, *sources in (part.split() for part in policy.split(";"))}
    assert directives["default-src"] == ["'none'"]
    assert directives["script-src"] == directives["style-src"] == ["'self'"]
