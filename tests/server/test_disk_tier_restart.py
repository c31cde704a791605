"""A real `streamd serve` process restarted on the same `cache.disk_cache_dir`: the first request that reuses
the long system prompt reports its full blocks as cached tokens (`usage.prompt_tokens_details`) and answers
the same greedy text as before the restart. (The light form, without processes: tests/engine/test_disk_tier_engine.py.)"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from openai import AsyncOpenAI

from tests.server.test_sigterm import SERVE, start_server

BLOCK_SIZE = 16
SYSTEM = "You are a terse assistant for a bicycle repair shop. " * 30  # a few hundred tokens


async def ask(port: int) -> tuple[str, int, int]:
    """The greedy answer, prompt tokens and cached tokens of one chat completion."""
    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which tyre first?"}],
            max_tokens=8,
            temperature=0,
        )
    usage = reply.usage
    assert usage is not None
    details = usage.prompt_tokens_details
    return reply.choices[0].message.content or "", usage.prompt_tokens, details.cached_tokens or 0 if details else 0


async def serve_once(directory: Path) -> tuple[tuple[str, int, int], int]:
    """Starts a server on `directory`, asks once, stops it with SIGTERM; the answer and the blocks the
    disk tier held at start."""
    proc, log, port = await start_server([*SERVE, "--set", f"cache.disk_cache_dir={directory}"])
    try:
        opened = await log.wait_for("disk_tier.opened", 10)
        answer = await ask(port)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 120) == 0, log.tail()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return answer, opened["blocks"]


async def test_a_restarted_server_finds_its_prefixes_on_disk(tmp_path: Path) -> None:
    (text, prompt_tokens, cached), blocks_at_start = await serve_once(tmp_path)
    assert blocks_at_start == 0 and cached == 0
    (text_after, prompt_after, cached_after), blocks_after = await serve_once(tmp_path)
    assert blocks_after >= prompt_tokens // BLOCK_SIZE  # the first server left its cached prefixes on disk
    assert prompt_after == prompt_tokens and text_after == text
    assert cached_after == (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # every full block but the last token's
