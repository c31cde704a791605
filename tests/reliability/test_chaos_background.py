"""The light form of `streamd bench chaos --background-kills` (issue 32's 1,000 kills): 20 background
Responses streams reset (TCP RST) at random events and resumed with `starting_after` against a live server;
every resume exact (each sequence number once, the reference's text) and no KV block left in use. `make test` runs 4 kills,
the full form 20 (~30 s idle, minutes on a loaded 2-core box)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from streamd.bench import chaos
from streamd.engine.client.async_engine import AsyncEngine
from tests.helpers import sizes
from tests.server.util import running_server  # (reliability: the session loop, see tests/conftest.py)


@pytest.mark.parametrize("kills", sizes(4, 20))
async def test_background_kills_resume_exactly(async_engine: AsyncEngine, kills: int) -> None:
    async with running_server(async_engine) as server:
        result = await _run(server.http, kills)
    done = result["background_kills"]
    assert done["kills"] == kills and done["errors"] == {}, done
    assert done["exact"] == kills and done["wrong_sequence"] == done["wrong_text"] == 0, done
    assert result["idle_after"] and result["leaked_kv_blocks"] == 0, result


async def _run(url: str, kills: int) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    chaos.add_arguments(parser)
    args = parser.parse_args(["--url", url, "--duration", "0", "--storm-clients", "0", "--fuzzers", "0",
                              "--slow-readers", "0", "--flooders", "0", "--schema-flooders", "0",
                              "--max-tokens", "12", "--background-kills", str(kills), "--background-concurrency", "4"])
    result = await chaos.run_chaos(args)
    assert [b for b in chaos.bound_breaches(result, args) if "background" in b] == []
    return result
