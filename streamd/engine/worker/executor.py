"""Executor: what LLMEngine calls to carry out a step's plan on the model and the KV cache.

`LocalExecutor` runs everything in the engine process (tensor parallel size 1).
`streamd.engine.worker.parallel.executor.TensorParallelExecutor` runs the same calls on every tensor-parallel rank.
Either way the engine calls the cache orders (`join_swaps`, `swap_out`, `swap_in`, `copy`, `swap_in_ahead`)
then `execute`, and reads
`failed` (an executor that lost a worker can never run a step again).

In the hybrid layout (`core/hybrid_blocks.py`) a second CacheEngine holds the sliding layers' pools; the
scheduler numbers its blocks after the first engine's (device and host alike), and `LocalExecutor` hands each
order to the engine its ids name (`split_orders`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from streamd.engine.core.scheduler_output import SchedulerOutput
from streamd.engine.worker.cache_engine import CacheEngine
from streamd.engine.worker.cpu_threads import ThreadGovernor
from streamd.engine.worker.model_runner import ModelRunner


class Executor(Protocol):
    cache: CacheEngine  # rank 0's pools (the whole pools without tensor parallelism)
    window: CacheEngine | None  # the hybrid layout's sliding-layer pools (None: `cache` holds every layer)

    @property
    def failed(self) -> bool: ...

    def swap_out(self, pairs: list[tuple[int, int]]) -> None: ...

    def swap_in(self, pairs: list[tuple[int, int]]) -> None: ...

    def swap_in_ahead(self, pairs: list[tuple[int, int]]) -> None: ...

    def join_swaps(self) -> None: ...

    def copy(self, pairs: list[tuple[int, int]]) -> None: ...

    def read_blocks(self, blocks: list[int]) -> list[bytes]: ...

    def read_host_blocks(self, blocks: list[int]) -> list[bytes]: ...

    def write_blocks(self, pairs: list[tuple[int, bytes]]) -> None: ...

    def execute(
        self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None, prev_rows: dict[int, int] | None = None
    ) -> torch.Tensor: ...

    def cpu_threads(self) -> int:
        """torch's threads the forward runs on now, on the CPU (0: the model is not on the CPU)."""
        ...

    def shutdown(self) -> None: ...


Pairs = list[tuple[int, int]]
Order = Callable[[CacheEngine], Callable[[Pairs], None]]  # an engine's order method (bound: tests record calls)


def split_orders(pairs: Pairs, device_at: int, offsets: tuple[int, int]) -> tuple[Pairs, Pairs]:
    """(the first engine's pairs, the window engine's with its offsets taken off): a pair is the window's when
    its device block (element `device_at`) is past the first engine's; `offsets` are each element's."""
    first, window = [], []
    limit = offsets[device_at]
    for pair in pairs:
        if pair[device_at] < limit:
            first.append(pair)
        else:
            window.append((pair[0] - offsets[0], pair[1] - offsets[1]))
    return first, window


class LocalExecutor:
    """The model and the KV cache of this process, used directly (`window`: the hybrid layout's second
    engine, the sliding layers' pools; `threads`: on the CPU, what sets torch's thread count before each step)."""

    def __init__(
        self,
        runner: ModelRunner,
        cache: CacheEngine,
        window: CacheEngine | None = None,
        threads: ThreadGovernor | None = None,
    ) -> None:
        self.runner = runner
        self.cache = cache
        self.window = window
        self.threads = threads

    @property
    def failed(self) -> bool:
        return False

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._route(lambda engine: engine.swap_out, pairs, 0, (self.cache.num_blocks, self.cache.num_swap_blocks))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._route(lambda engine: engine.swap_in, pairs, 1, (self.cache.num_swap_blocks, self.cache.num_blocks))

    def swap_in_ahead(self, pairs: list[tuple[int, int]]) -> None:
        self.cache.swap_in_ahead(pairs)

    def join_swaps(self) -> None:
        self.cache.join_swaps()

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self._route(lambda engine: engine.copy, pairs, 0, (self.cache.num_blocks, self.cache.num_blocks))

    def _route(self, order: Order, pairs: Pairs, device_at: int, offsets: tuple[int, int]) -> None:
        """Each engine's `order` (looked up on the engine, as a bound method) with its pairs (`split_orders`); all
        to `cache` without a window engine."""
        if self.window is None:
            order(self.cache)(pairs)
            return
        first, window = split_orders(pairs, device_at, offsets)
        order(self.cache)(first)
        order(self.window)(window)

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        return self.cache.read_blocks(blocks)

    def read_host_blocks(self, blocks: list[int]) -> list[bytes]:
        return self.cache.read_host_blocks(blocks)

    def write_blocks(self, pairs: list[tuple[int, bytes]]) -> None:
        self.cache.write_blocks(pairs)

    def execute(
        self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None, prev_rows: dict[int, int] | None = None
    ) -> torch.Tensor:
        if self.threads is not None:
            self.threads.tick()
        return self.runner.execute(out, prev_tokens, prev_rows)

    def cpu_threads(self) -> int:
        if self.runner.device.type != "cpu":
            return 0
        return self.threads.threads if self.threads is not None else torch.get_num_threads()

    def shutdown(self) -> None:
        pass
