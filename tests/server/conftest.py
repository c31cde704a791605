"""Server test fixtures: real uvicorn servers on random 127.0.0.1 ports built around the session's one
AsyncEngine (`async_engine`, in tests/conftest.py: tests/reliability shares it). Every test ends by
waiting (on engine deliveries, not sleeps) until the engine is idle; the root conftest's leak check then finds the KV pool whole."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from streamd.engine.client.async_engine import AsyncEngine
from tests.server.util import Server, running_server


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def server(async_engine: AsyncEngine) -> AsyncIterator[Server]:
    """The default test server: no keys, 64 KiB frames, 8 requests per connection, and a 1 s resume grace (a
    dropped socket's requests end 1 s later, not after the default 30 s that the idle check would wait out)."""
    async with running_server(async_engine, max_frame_bytes=65536, max_requests_per_connection=8,
                              resume_grace_s=1.0) as srv:
        yield srv


@pytest_asyncio.fixture(autouse=True, loop_scope="session")
async def _engine_idle_around_test(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Before: fresh stats (tests/engine steps the same engine offline, behind the loop's back, and a test that
    reads the metrics or the stats feed would count that work as its own). After: idle and the pool whole."""
    if "async_engine" in request.fixturenames:
        await request.getfixturevalue("async_engine").wait_idle()  # its call refreshes stats()
    yield
    if "async_engine" in request.fixturenames:
        engine: AsyncEngine = request.getfixturevalue("async_engine")
        stats = await engine.wait_idle(timeout=120)
        assert stats.kv.blocks_free == stats.kv.blocks_total, f"KV blocks leaked: {stats}"
