"""Progress before the first token (issue 32): the engine reports a waiting request's queue place and each
prompt chunk it completed; `/v1/stream` sends them as `progress` frames and the Responses API as
`response.queued` then `response.in_progress` (through the official `openai` SDK). Three long prompts sent at
once on the session engine with one seat: the first prefills in chunks (256 tokens per step) while the others
wait."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

from openai import AsyncOpenAI

from tests.server.util import Server, check_stream, gather_until_done, send, ws_connect


def long_prompt() -> str:
    """~600 tokens (three 256-token chunks at most), new from its first token (no prefix cache hit)."""
    return f"{uuid.uuid4().hex}. " + " ".join(f"item {i} is blue." for i in range(75))


@contextlib.asynccontextmanager
async def one_seat(server: Server) -> AsyncIterator[None]:
    """One seat (`max_num_seqs`): the second and third prompts wait for the first however fast the machine
    is (with free seats, whether one waits depends on the step's measured cost, and on a loaded box a waiting
    request's queue report can be merged into its first chunk's before the route reads it)."""
    engine = server.services.engine
    before = await engine.call(lambda e: e.scheduler.max_num_seqs)
    await engine.call(lambda e: setattr(e.scheduler, "max_num_seqs", 1))
    try:
        yield
    finally:
        await engine.call(lambda e: setattr(e.scheduler, "max_num_seqs", before))


async def test_progress_frames_come_before_the_first_delta(server: Server) -> None:
    async with one_seat(server), ws_connect(server) as ws:
        for name in "abc":
            await send(ws, type="generate", id=name, prompt=long_prompt(), params={"max_tokens": 2})
        results = await gather_until_done(ws, set("abc"))
    seen_waiting = seen_chunk = False
    for name, result in results.items():
        check_stream(result)
        kinds = [f["type"] for f in result.frames]
        first_delta = kinds.index("delta")
        assert "progress" not in kinds[first_delta:], kinds
        progress = result.of("progress")
        assert progress, f"{name}: no progress before its first token: {kinds}"
        prompt_tokens = result.frames[0]["prompt_tokens"]
        for frame in progress:
            assert frame["prompt_tokens"] == prompt_tokens
            assert 0 <= frame["cached_tokens"] <= frame["prompt_tokens_done"] < prompt_tokens, frame
            assert frame["queue_position"] is None or (frame["queue_position"] >= 1
                                                       and frame["prompt_tokens_done"] == 0), frame
        done = [f["prompt_tokens_done"] for f in progress]
        assert done == sorted(done), done
        places = [f["queue_position"] for f in progress if f["queue_position"] is not None]
        assert places == sorted(places, reverse=True), places  # a waiting request only moves up
        seen_waiting = seen_waiting or bool(places)
        seen_chunk = seen_chunk or any(f["queue_position"] is None and f["prompt_tokens_done"] > 0 for f in progress)
    assert seen_waiting, "with three long prompts at once, one waited"
    assert seen_chunk, "a five-chunk prompt reported a chunk done"


async def test_responses_queued_then_in_progress(server: Server) -> None:
    client = AsyncOpenAI(base_url=f"{server.http}/v1", api_key="unused", max_retries=0, timeout=300)

    async def run() -> list[Any]:
        stream = await client.responses.create(model=server.services.model_name, input=long_prompt(),
                                               max_output_tokens=2, temperature=0, stream=True)
        return [event async for event in stream]

    async with one_seat(server):
        runs = await asyncio.gather(*(run() for _ in range(3)))
    queued = 0
    for events in runs:
        kinds = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert kinds[0] == "response.created" and kinds.count("response.in_progress") == 1, kinds
        start = kinds.index("response.in_progress")
        assert kinds[1:start] in ([], ["response.queued"]), kinds
        assert kinds[start + 1] == "response.output_item.added", kinds
        if kinds[1] == "response.queued":
            assert events[1].response.status == "queued"
            queued += 1
        assert events[-1].type in ("response.completed", "response.incomplete")
    assert queued >= 1, "with three long prompts at once, one waited"
