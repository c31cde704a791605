"""Issue 35 D9 against a live server: a long prompt no longer freezes the streams running beside it. Its
prefill is cut into chunks that keep each step under the scheduler's latency budget, so a stream on the same
socket keeps getting tokens between the long request's `start` and its first token (one step used to run
the whole prompt: at most one delta of the stream in between). Counted in deltas, never timed; the
budget is set small (50 ms) so that the prompt is cut on any machine."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest_asyncio

from streamd.engine import LLMEngine
from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import Server, recv_frames, send, ws_connect

WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "sky", "with", "quiet", "joy")


@pytest_asyncio.fixture(loop_scope="session")
async def small_step_budget(async_engine: AsyncEngine) -> AsyncIterator[None]:
    """A 50 ms step budget, and the default token budget (8192: the shared engine's 256 would cut the prompt
    into chunks by itself), so that only the latency budget can keep the stream going."""

    def configure(max_step_s: float | None, max_num_batched_tokens: int) -> Callable[[LLMEngine], tuple[Any, int]]:
        def swap(engine: LLMEngine) -> tuple[Any, int]:
            scheduler = engine.scheduler
            before = (scheduler.max_step_s, scheduler.max_num_batched_tokens)
            scheduler.max_step_s, scheduler.max_num_batched_tokens = max_step_s, max_num_batched_tokens
            return before

        return swap

    before = await async_engine.call(configure(0.05, 8192))
    yield
    await async_engine.call(configure(*before))


async def test_a_stream_keeps_getting_tokens_while_a_long_prompt_is_prefilled(
    rserver: Server, small_step_budget: None
) -> None:
    prompt = " ".join(random.Random(0).choice(WORDS) for _ in range(1200))
    async with ws_connect(rserver) as ws:
        await send(ws, type="generate", id="stream", prompt="Count:", params={"max_tokens": 256, "ignore_eos": True})
        while (await recv_frames(ws))[0]["type"] != "delta":
            pass  # the stream runs
        await send(ws, type="generate", id="long", prompt=prompt, params={"max_tokens": 1})
        between, long_started, long_prompt_tokens = 0, False, 0
        while True:
            frames = await recv_frames(ws)
            for frame in frames:
                if frame["id"] == "long" and frame["type"] == "start":
                    long_started, long_prompt_tokens = True, frame["prompt_tokens"]
                elif frame["id"] == "stream" and frame["type"] == "delta" and long_started:
                    between += 1
            if any(f["id"] == "long" and f["type"] in ("delta", "done") for f in frames):
                break
        assert long_prompt_tokens > 1000
        assert between >= 3, f"the stream got {between} deltas while {long_prompt_tokens} prompt tokens were prefilled"
        await send(ws, type="cancel", id="stream")
        while not any(f["id"] == "stream" and f["type"] == "done" for f in await recv_frames(ws)):
            pass
