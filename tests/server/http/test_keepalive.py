"""SSE keepalive behind a real nginx whose `proxy_read_timeout` is shorter than the request's prefill: the
`: keepalive` comments (`server.sse_keepalive_s`) keep chat completions and the Responses API streaming to
the end, through the official `openai` SDK; with keepalive off the proxy cuts the same stream (the control).
The light form of issue 32's target (90 s prefill behind `proxy_read_timeout 30s`: `streamd bench live --scenarios
proxy`, results/live-proxy-2026-11-27-cpu.md)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from openai import AsyncOpenAI

from streamd.bench.live import nginx_in_front
from streamd.cli.cluster import nginx_binary
from streamd.engine.client.async_engine import AsyncEngine
from streamd.server.tokenizing import INLINE_CHARS
from tests.helpers import sizes
from tests.server.util import Server, running_server

NGINX = nginx_binary()
pytestmark = pytest.mark.skipif(not Path(NGINX).exists(), reason="needs nginx (apt); `make test` installs it")

READ_TIMEOUT_MS = 2500  # the proxy's idle timeout: far below the long prompt's prefill on CPU
KEEPALIVE_S = 0.25

def long_prompt() -> str:
    """~2,300 tokens (nine 256-token chunks on the session engine: seconds of prefill on CPU), each call's
    new from its first token, so the prefix cache never shortens the prefill."""
    return f"{uuid.uuid4().hex}. " + " ".join(f"item {i} is blue." for i in range(300))


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def proxied(async_engine: AsyncEngine) -> AsyncIterator[tuple[Server, str]]:
    async with running_server(async_engine, sse_keepalive_s=KEEPALIVE_S) as srv:
        await _warm(srv)
        with nginx_in_front(srv.http, READ_TIMEOUT_MS / 1000) as front:
            yield srv, front


async def _warm(srv: Server) -> None:
    """The long-input tokenizer's worker starts (its first use takes seconds on 2 cores, all before the
    response's head, which no keepalive can cover); started here without a request's prefill."""
    await srv.services.generation.tokenizing.run(lambda tokenizer: tokenizer("warm"), INLINE_CHARS + 1)


def _sdk(base: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


async def _raw_chat(base: str, model: str) -> tuple[list[str], float]:
    """A streamed chat's raw SSE lines through the proxy and the seconds before its first content."""
    body = {"model": model, "messages": [{"role": "user", "content": long_prompt()}], "max_tokens": 4,
            "stream": True, "temperature": 0}
    lines: list[str] = []
    began, first = time.monotonic(), 0.0
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body) as answer:
            assert answer.status_code == 200, await answer.aread()
            async for line in answer.aiter_lines():
                if '"content":"' in line and '"content":""' not in line and not first:
                    first = time.monotonic() - began
                lines.append(line)
    return lines, first


async def test_chat_stream_outlives_the_proxy_idle_timeout(proxied: tuple[Server, str]) -> None:
    srv, front = proxied
    lines, first = await _raw_chat(front, srv.services.model_name)
    assert first > READ_TIMEOUT_MS / 1000, f"the prefill ({first:.2f} s) must outlast the proxy's timeout"
    assert lines.count(": keepalive") >= 2, lines[:20]
    assert lines[-2:] == ["data: [DONE]", ""], lines[-4:]


# The SDK's Responses stream runs in `make test` (the raw chat stream above covers chat completions there);
# the SDK's chat stream is the full form.
@pytest.mark.parametrize("api", sizes("responses", "chat"))
async def test_sdk_streams_complete_through_the_proxy(proxied: tuple[Server, str], api: str) -> None:
    srv, front = proxied
    client, model = _sdk(front), srv.services.model_name
    if api == "chat":
        chat = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": long_prompt()}], max_tokens=4, temperature=0,
            stream=True)
        chunks = [chunk async for chunk in chat]
        assert chunks[-1].choices[0].finish_reason in ("stop", "length"), chunks[-1]
        return
    events = [e async for e in await client.responses.create(
        model=model, input=long_prompt(), max_output_tokens=4, temperature=0, stream=True)]
    assert events[-1].type in ("response.completed", "response.incomplete"), events[-1]
    assert [e.sequence_number for e in events] == list(range(len(events)))


async def test_without_keepalive_the_proxy_cuts_the_stream(async_engine: AsyncEngine) -> None:
    """The control: the same stream with keepalive off dies at the proxy (so the tests above test something)."""
    async with running_server(async_engine, sse_keepalive_s=0) as srv:
        await _warm(srv)
        with nginx_in_front(srv.http, READ_TIMEOUT_MS / 1000) as front:
            with pytest.raises(httpx.RemoteProtocolError):
                await _raw_chat(front, srv.services.model_name)
