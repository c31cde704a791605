"""Executor: what LLMEngine calls to carry out a step's plan on the model and the KV cache.

`LocalExecutor` runs everything in the engine process (tensor parallel size 1).
`streamd.engine.worker.parallel.executor.TensorParallelExecutor` runs the same calls on every tensor-parallel rank.
Either way the engine calls the cache orders (`join_swaps`, `swap_out`, `swap_in`, `copy`, `swap_in_ahead`)
then `execute`, and reads
`failed` (an executor that lost a worker can never run a step again).
"""

from __future__ import annotations

from typing import Protocol

import torch

from streamd.engine.core.scheduler_output import SchedulerOutput
from streamd.engine.worker.cache_engine import CacheEngine
from streamd.engine.worker.model_runner import ModelRunner


class Executor(Protocol):
    cache: CacheEngine  # rank 0's pools (the whole pools without tensor parallelism)

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

    def shutdown(self) -> None: ...


class LocalExecutor:
    """The model and the KV cache of this process, used directly."""

    def __init__(self, runner: ModelRunner, cache: CacheEngine) -> None:
        self.runner = runner
        self.cache = cache

    @property
    def failed(self) -> bool:
        return False

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.cache.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.cache.swap_in(pairs)

    def swap_in_ahead(self, pairs: list[tuple[int, int]]) -> None:
        self.cache.swap_in_ahead(pairs)

    def join_swaps(self) -> None:
        self.cache.join_swaps()

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self.cache.copy(pairs)

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        return self.cache.read_blocks(blocks)

    def read_host_blocks(self, blocks: list[int]) -> list[bytes]:
        return self.cache.read_host_blocks(blocks)

    def write_blocks(self, pairs: list[tuple[int, bytes]]) -> None:
        self.cache.write_blocks(pairs)

    def execute(
        self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None, prev_rows: dict[int, int] | None = None
    ) -> torch.Tensor:
        return self.runner.execute(out, prev_tokens, prev_rows)

    def shutdown(self) -> None:
        pass
