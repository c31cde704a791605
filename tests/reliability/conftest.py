"""Reliability fixtures: a live server with small limits around the session's shared engine, and the
checks that end every test: the engine idle with its KV pool whole, no connection left open, and the
process's file descriptor count back where it started (client and server live in this process)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from streamd.engine.client.async_engine import AsyncEngine
from tests.reliability.util import LIMITS, fd_count, settle
from tests.server.util import Server, running_server


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def rserver(async_engine: AsyncEngine) -> AsyncIterator[Server]:
    async with running_server(async_engine, **LIMITS) as srv:
        yield srv


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def _whole_after_test(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    names = request.fixturenames
    servers = [request.getfixturevalue(n) for n in ("rserver", "tiny_server", "lserver") if n in names]
    for srv in servers:
        await settle(srv)
    if "async_engine" in names:  # fresh stats: tests/engine steps the same engine offline (tests/server/conftest.py)
        await request.getfixturevalue("async_engine").wait_idle()
    before = fd_count()
    yield
    for name in ("async_engine", "tiny_engine"):
        if name in names:
            stats = await request.getfixturevalue(name).wait_idle(timeout=120)
            assert stats.kv.blocks_free == stats.kv.blocks_total, f"KV blocks leaked: {stats}"
    for srv in servers:
        await settle(srv)
    if servers:
        assert fd_count() <= before, "file descriptors leaked"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def tiny_engine() -> AsyncIterator[AsyncEngine]:
    """The default model with a KV pool of 16 blocks (256 tokens) and a small swap pool: a few streams
    preempt each other (swap or recompute, whichever the engine estimates cheaper). Float weights, as the shared
    engine's: the tests compare greedy tokens across preemption, which bfloat16 low-bit matmuls (a recomputed
    prefill rounds otherwise than the decode steps it replaces) do not keep bit for bit."""
    from streamd import LLM
    from tests.helpers import register_engine

    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=16, num_swap_blocks=8, max_num_batched_tokens=64,
              quantization="none")
    register_engine(llm.engine)
    engine = AsyncEngine(llm.engine)
    engine.start()
    yield engine
    await engine.shutdown()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def tiny_server(tiny_engine: AsyncEngine) -> AsyncIterator[Server]:
    async with running_server(tiny_engine, **LIMITS) as srv:
        yield srv
