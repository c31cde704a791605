"""The live engine view: `stats` frames pushed to a WebSocket that sent `subscribe_stats`.

A connection that subscribes gets one `stats` frame at once and then one every `interval_ms` (default 500)
until it sends `unsubscribe_stats` or closes; nothing is computed for connections that did not subscribe.
Each frame is built from the typed `EngineStats` snapshot the engine thread hands over after every step
(`EngineClient.stats()`, no extra call into the engine), so the page never parses `/metrics` text.

Frame (documented in docs/SERVER.md, protocol section):
`{"type":"stats","kv":{"total","used","cached","free"},"swap":{"total","used"},
"requests":{"running","waiting","swapped","paused"},"prefix_cache":{"queried_tokens","hit_tokens","hit_rate","tiers"},
"speculation":{"draft_tokens","accepted_tokens","acceptance_rate"},"generated_tokens":N,"tokens_per_s":X}`.
KV `free` excludes `cached` (free blocks still holding a findable prefix), so used + cached + free = total.
`tokens_per_s` is the output-token rate since the previous frame.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from streamd.engine import EngineClient, EngineStats
from streamd.server.tenants import tenant_totals
from streamd.server.ws.protocol import Frame


@dataclass(slots=True, frozen=True)
class Sample:
    """The generated-token count at a moment (monotonic seconds), for the rate between two frames."""

    time: float
    generated_tokens: int


def stats_frame(stats: EngineStats, tokens_per_s: float, tenant_label: Callable[[str], str] = str) -> Frame:
    """The engine view's numbers; tenants by `tenant_label` (configured names, the rest as "other")."""
    kv, sched = stats.kv, stats.scheduler
    queried = kv.prefix_queried_tokens
    return {
        "type": "stats",
        "kv": {
            "total": kv.blocks_total,
            "used": kv.blocks_used,
            "cached": kv.blocks_cached,
            "free": kv.blocks_free - kv.blocks_cached,
        },
        "swap": {"total": kv.swap_blocks_total, "used": kv.swap_blocks_used},
        "requests": {
            "running": sched.num_running,
            "waiting": sched.num_waiting,
            "swapped": sched.num_swapped,
            "paused": sched.num_paused,
        },
        "prefix_cache": {
            "queried_tokens": queried,
            "hit_tokens": kv.prefix_hit_tokens,
            "hit_rate": kv.prefix_hit_tokens / queried if queried else 0.0,
            "tiers": [{"name": "device", "hit_blocks": kv.device_hit_blocks}]
            + [{"name": t.name, "hit_blocks": t.hit_blocks, "blocks": t.blocks} for t in kv.tiers],
        },
        "speculation": {
            "draft_tokens": sched.spec_draft_tokens,
            "accepted_tokens": sched.spec_accepted_tokens,
            "acceptance_rate": sched.spec_accepted_tokens / sched.spec_draft_tokens if sched.spec_draft_tokens else 0.0,
        },
        "generated_tokens": stats.generated_tokens,
        "tokens_per_s": round(tokens_per_s, 2),
        "tenants": [asdict(row) for row in tenant_totals(sched.tenants, tenant_label)],
    }


def token_rate(before: Sample, after: Sample) -> float:
    elapsed = after.time - before.time
    return max(0, after.generated_tokens - before.generated_tokens) / elapsed if elapsed > 0 else 0.0


class StatsFeed:
    """One connection's subscription: a task that pushes a frame every interval while subscribed."""

    def __init__(
        self, engine: EngineClient, push: Callable[[Frame], None], tenant_label: Callable[[str], str] = str
    ) -> None:
        self._engine = engine
        self._push = push
        self._tenant_label = tenant_label
        self._task: asyncio.Task[None] | None = None

    def subscribe(self, interval_s: float) -> None:
        """(Re)starts the feed at `interval_s`; the first frame goes out at once."""
        self.stop()
        self._task = asyncio.create_task(self._run(interval_s))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _run(self, interval_s: float) -> None:
        last = self._sample()
        rate = 0.0
        while True:
            self._push(stats_frame(self._engine.stats(), rate, self._tenant_label))
            await asyncio.sleep(interval_s)  # the feed's period, not a synchronization
            now = self._sample()
            rate, last = token_rate(last, now), now

    def _sample(self) -> Sample:
        return Sample(time.monotonic(), self._engine.stats().generated_tokens)
