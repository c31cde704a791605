"""The live engine view's `stats` frames: built from the typed EngineStats (pure), and pushed on a real
socket only while subscribed, following a real generation."""

from __future__ import annotations

from typing import Any

from websockets.asyncio.client import ClientConnection

from streamd.engine.client.async_engine import AsyncEngine
from streamd.engine.stats import EngineStats, KVCacheStats, SchedulerStats, TenantStats, TierStats
from streamd.server.ws.stats_feed import Sample, stats_frame, token_rate
from tests.server.util import Server, recv, send, ws_connect


def test_frame_from_engine_stats() -> None:
    kv = KVCacheStats(blocks_total=100, blocks_free=70, blocks_cached=20, swap_blocks_total=40, swap_blocks_free=31,
                      swapped_out_blocks=12, swapped_in_blocks=3, prefix_queried_tokens=400, prefix_hit_tokens=100,
                      allocated_blocks=90, copied_blocks=2, device_hit_blocks=5,
                      tiers=[TierStats("disk", blocks=30, hit_blocks=7, bytes_read=70,
                                       bytes_written=300)])
    sched = SchedulerStats(num_running=3, num_waiting=2, num_swapped=1, preemptions_swap=1, preemptions_recompute=0,
                           recomputed_tokens=0, num_paused=4, spec_draft_tokens=80, spec_accepted_tokens=60,
                           tenants=[TenantStats("alice", 10, 5, 1, 20.0, 2, 0.5),
                                    TenantStats("key-1f2e", 7, 3, 0, 13.0, 1, 0.25),
                                    TenantStats("user-9a8b", 100, 50, 2, 200.0, 3, 1.5)])
    named = {"alice"}.__contains__
    frame = stats_frame(EngineStats(kv, sched, num_requests=6, generated_tokens=1234), tokens_per_s=12.345,
                        tenant_label=lambda name: name if named(name) else "other")
    assert frame == {
        "type": "stats",
        "kv": {"total": 100, "used": 30, "cached": 20, "free": 50},
        "swap": {"total": 40, "used": 9},
        "requests": {"running": 3, "waiting": 2, "swapped": 1, "paused": 4},
        "prefix_cache": {"queried_tokens": 400, "hit_tokens": 100, "hit_rate": 0.25,
                         "tiers": [{"name": "device", "hit_blocks": 5}, {"name": "disk", "hit_blocks": 7, "blocks": 30}]},
        "speculation": {"draft_tokens": 80, "accepted_tokens": 60, "acceptance_rate": 0.75},
        "generated_tokens": 1234,
        "tokens_per_s": 12.35,
        "tenants": [  # unnamed tenants (digests) summed as "other", most served first
            {"tenant": "other", "prompt_tokens": 107, "output_tokens": 53, "preemptions": 2, "admissions": 4,
             "queue_seconds": 1.75},
            {"tenant": "alice", "prompt_tokens": 10, "output_tokens": 5, "preemptions": 1, "admissions": 2,
             "queue_seconds": 0.5},
        ],
    }
    assert sum(frame["kv"][part] for part in ("used", "cached", "free")) == kv.blocks_total


def test_token_rate() -> None:
    assert token_rate(Sample(10.0, 100), Sample(10.5, 150)) == 100.0
    assert token_rate(Sample(10.0, 100), Sample(10.0, 150)) == 0.0  # no time passed: no rate


async def next_stats(ws: ClientConnection) -> dict[str, Any]:
    while (frame := await recv(ws))["type"] != "stats":
        pass
    return frame


async def test_stats_follow_a_generation(server: Server, async_engine: AsyncEngine) -> None:
    """Subscribed: a frame at once, frames while a request runs (it shows as running, holding blocks), and
    the generated-token count moves by exactly the request's output; unsubscribed: no more frames."""
    async with ws_connect(server) as ws:
        await send(ws, type="subscribe_stats", interval_ms=100)
        first = await recv(ws)
        assert first["type"] == "stats" and first["requests"]["running"] == 0
        assert first["kv"]["used"] == 0 and first["kv"]["total"] == async_engine.stats().kv.blocks_total
        await send(ws, type="generate", id="g", prompt="Once upon a time",
                   params={"max_tokens": 64, "ignore_eos": True, "temperature": 0})
        during, done = [], None
        while done is None:
            frame = await recv(ws)
            if frame["type"] == "stats":
                during.append(frame)
            elif frame["type"] == "done":
                done = frame
        assert any(f["requests"]["running"] == 1 and f["kv"]["used"] > 0 and f["tokens_per_s"] > 0 for f in during)
        await async_engine.wait_idle()
        while (last := await next_stats(ws))["requests"]["running"]:
            pass
        assert last["generated_tokens"] - first["generated_tokens"] == done["usage"]["completion_tokens"] == 64
        assert last["kv"]["used"] == 0
        await send(ws, type="unsubscribe_stats")
        await send(ws, type="generate", id="h", prompt="Hello", params={"max_tokens": 8, "ignore_eos": True})
        kinds = []
        while not kinds or kinds[-1] != "done":
            kinds.append((await recv(ws))["type"])
        assert "stats" not in kinds and kinds[0] == "start"


async def test_bad_subscription_gets_an_error_frame(server: Server) -> None:
    async with ws_connect(server) as ws:
        await send(ws, type="subscribe_stats", interval_ms=5)
        error = await recv(ws)
        assert error == {"type": "error", "id": None, "error": {
            "code": "invalid_request", "message": "interval_ms must be an integer from 100 to 10000"}}
