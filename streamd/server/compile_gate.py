"""Heavy grammar compiles, bounded per server and per API key, so cheap-to-send schemas cannot take the CPU.

An xgrammar compile cannot be interrupted: the engine's budget (`grammar_budget.py`, 400 naming the limit)
bounds what one compile may cost; this gate bounds how many run at once. A spec that is not light takes a
slot of the server (`grammar.max_concurrent_compiles`) and of its API key (`..._per_key`; key-less clients
share one count) before its grammar compiles, and keeps it until the compile has finished, even when its
client left first (the compile goes on, so its CPU is still taken); no free slot: 503 `overloaded` with
Retry-After. A light spec compiles in milliseconds and never waits for a slot, so a trivial schema does
not queue behind big ones. A request waits at most `grammar.compile_timeout_s` for its grammar (503).

With the engine in its own process the grammar compiles there, at admission (engine_child.py); the slot is
then held until the request is admitted, which bounds how many heavy adds wait in the engine process.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable
from typing import Any

from streamd.config import GrammarConfig
from streamd.engine import GrammarBudget, SamplingParams, grammar_size
from streamd.server.errors import ServiceError


class CompileGate:
    def __init__(self, config: GrammarConfig) -> None:
        self.config = config
        self.budget = GrammarBudget.of(config)  # the engine's own check, here before any slot is taken
        self._per_key: Counter[str] = Counter()

    @property
    def in_flight(self) -> int:
        """Heavy compiles holding a slot now."""
        return sum(self._per_key.values())

    def enter(self, params: SamplingParams, key: str | None) -> str | None:
        """Takes a slot for a heavy spec (returns the key it counts under; None: no slot needed), or
        refuses: a spec over the budget or that cannot be measured (GrammarError, naming why), no free
        slot (503)."""
        spec = params.structured_outputs
        if spec is None:
            return None
        size = grammar_size(spec)
        self.budget.check(size)
        if size.light:
            return None
        tenant = key or ""
        if self.in_flight >= self.config.max_concurrent_compiles:
            raise self._busy("this server", "grammar.max_concurrent_compiles")
        if self._per_key[tenant] >= self.config.max_concurrent_compiles_per_key:
            raise self._busy(
                "this API key" if key else "clients without an API key", "grammar.max_concurrent_compiles_per_key"
            )
        self._per_key[tenant] += 1
        return tenant

    def leave(self, tenant: str | None, compiling: asyncio.Future[Any] | None) -> None:
        """Gives the slot back once `compiling` (the compile, which runs on after its client left) is done."""
        if tenant is None:
            return
        if compiling is None or compiling.done():
            self._release(tenant)
        else:
            compiling.add_done_callback(lambda _: self._release(tenant))

    def start(self, compiling: Awaitable[None]) -> asyncio.Future[None]:
        """The compile, started: it runs to its end even when its waiter is cancelled or times out."""
        future = asyncio.ensure_future(compiling)
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # (retrieved: never "unhandled")
        return future

    async def wait(self, compiling: asyncio.Future[None]) -> None:
        """Waits for a started compile at most `grammar.compile_timeout_s` (then 503)."""
        try:
            async with asyncio.timeout(self.config.compile_timeout_s):
                await asyncio.shield(compiling)
        except TimeoutError:
            raise ServiceError(
                "overloaded",
                f"structured_outputs did not compile within {self.config.compile_timeout_s:g} s "
                "(grammar.compile_timeout_s); retry later",
                "structured_outputs",
            ) from None

    def _release(self, tenant: str) -> None:
        self._per_key[tenant] -= 1
        if not self._per_key[tenant]:
            del self._per_key[tenant]

    def _busy(self, whom: str, key: str) -> ServiceError:
        return ServiceError(
            "overloaded",
            f"too many large structured-output schemas are compiling for {whom} ({key}); retry later",
            "structured_outputs",
        )
