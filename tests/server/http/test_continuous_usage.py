"""vLLM's `stream_options.continuous_usage_stats` on chat and completions, through the official `openai` SDK:
every chunk carries the request's usage so far, counting up to the final usage chunk's."""

from __future__ import annotations

from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.server.util import Server

OPTIONS = {"include_usage": True, "continuous_usage_stats": True}


def _client(server: Server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=120)


def _check_counts(chunks: list[Any]) -> None:
    *body, final = chunks
    assert final.choices == [] and final.usage is not None
    assert all(c.usage is not None for c in body), [c for c in body if c.usage is None][:1]
    counts = [c.usage.completion_tokens for c in body]
    assert counts == sorted(counts) and counts[0] < counts[-1] == final.usage.completion_tokens, counts
    assert all(c.usage.prompt_tokens == final.usage.prompt_tokens for c in body)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in body)


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_every_chunk_carries_the_usage_so_far(server: Server, kind: str) -> None:
    client, model = _client(server), server.services.model_name
    common: dict[str, Any] = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True,
                              "stream_options": OPTIONS}
    if kind == "chat":
        stream: Any = await client.chat.completions.create(
            messages=[{"role": "user", "content": "Count to ten."}], **common)
    else:
        stream = await client.completions.create(prompt="One, two, three,", **common)
    _check_counts([chunk async for chunk in stream])


async def test_without_the_option_chunks_carry_no_usage(server: Server) -> None:
    stream = await _client(server).chat.completions.create(
        model=server.services.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True})
    *body, final = [chunk async for chunk in stream]
    assert all(c.usage is None for c in body) and final.usage is not None
