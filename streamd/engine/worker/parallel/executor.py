"""TensorParallelExecutor: rank 0's executor. It runs every order on its own shard and sends the same
orders, and the step's batch, to the worker ranks in one broadcast per step.

Cache orders (swap out, swap in, copy-on-write) take effect on rank 0 at once and are queued for the
workers; they travel in the next step's message, before its forward, in the order they were given. Only
forwards and cache orders touch a worker's pools, so applying a step's orders just before the next forward
leaves every rank's shard of every block exactly as rank 0's.

A lost worker (its process gone, a collective that failed or timed out) fails the step with
`WorkerFailedError` and leaves the executor `failed`: every later step fails at once, so the engine loop
fails the requests in flight and, after its consecutive-failure limit, reports the engine dead (`/ready`
503). The engine does not restart workers: the server process must be restarted.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from streamd.engine.core.scheduler_output import SchedulerOutput
from streamd.engine.worker.cache_engine import CacheEngine
from streamd.engine.worker.model_runner import ModelRunner
from streamd.engine.worker.parallel.step_message import (
    CacheOrder,
    Command,
    OrderKind,
    StepChannel,
    StepMessage,
    apply_order,
)
from streamd.engine.worker.parallel.workers import WorkerPool, all_agree, close_group
from streamd.logs import get_logger

log = get_logger(__name__)

_STOP_TIMEOUT_S = 10.0


class WorkerFailedError(RuntimeError):
    """A tensor-parallel worker died or a collective failed; the engine cannot run steps any more."""


class TensorParallelExecutor:
    def __init__(self, runner: ModelRunner, cache: CacheEngine, workers: WorkerPool) -> None:
        self.runner = runner
        self.cache = cache
        self.window: CacheEngine | None = None  # (the hybrid layout is off under tensor parallelism)
        self.workers = workers
        self._channel = StepChannel(workers.groups.control, workers.groups.collectives, workers.device)
        self._orders: list[CacheOrder] = []
        self._failure: str | None = None  # why a worker was lost
        self._closed = False
        # Workers are daemon processes; this also ends them when the engine is dropped without shutdown().
        self._finalizer = weakref.finalize(self, workers.stop, 0.0)
        self._send(StepMessage(Command.ALLOCATE, args=(cache.num_blocks, cache.num_swap_blocks)))

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._order(OrderKind.SWAP_OUT, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._order(OrderKind.SWAP_IN, pairs)

    def swap_in_ahead(self, pairs: list[tuple[int, int]]) -> None:
        """A plain swap-in on every rank (the step message carries no ahead order yet): correct, not overlapped."""
        self._order(OrderKind.SWAP_IN, pairs)

    def join_swaps(self) -> None:
        pass  # (nothing is swapped in ahead here)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self._order(OrderKind.COPY, pairs)

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        return _no_tier_orders(blocks)

    def read_host_blocks(self, blocks: list[int]) -> list[bytes]:
        return _no_tier_orders(blocks)

    def write_blocks(self, pairs: list[tuple[int, bytes]]) -> None:
        _no_tier_orders(pairs)

    def cpu_threads(self) -> int:
        """Each rank sets its own threads (`workers.py`); rank 0's here, on the CPU."""
        return torch.get_num_threads() if self.runner.device.type == "cpu" else 0

    def execute(
        self, out: SchedulerOutput, prev_tokens: torch.Tensor | None = None, prev_rows: dict[int, int] | None = None
    ) -> torch.Tensor:
        self._check()
        batch = self.runner.prepare(out, prev_tokens, prev_rows)
        orders, self._orders = self._orders, []
        graph_size = self.runner.graph_size(batch)
        self._send(StepMessage(Command.STEP, orders, batch, graph_size=graph_size))
        try:
            return self.runner.run(batch, graph_size)
        except RuntimeError as exc:  # the all-reduces of the layers
            raise self._fail(f"tensor-parallel forward failed: {exc}") from exc

    def capture_cuda_graphs(self, max_batch: int, max_blocks: int) -> bool:
        """Every rank captures its decode graphs, size by size together; if any rank fails a size, none
        keeps graphs and decode stays eager (logged), rather than failing the engine."""
        self._send(StepMessage(Command.CAPTURE, args=(max_batch, max_blocks)))
        group, world = self.workers.groups.control, len(self.workers.processes) + 1
        captured = self.runner.capture_cuda_graphs(max_batch, max_blocks, agree=lambda ok: all_agree(group, ok, world))
        log.info("tensor_parallel.cuda_graphs", captured=captured)
        return captured

    def shutdown(self) -> None:
        """Stops the workers: SHUTDOWN (each worker then releases its graphs and shuts its groups down),
        rank 0's graphs released and its groups shut down (aborted if a worker was lost), then terminate
        whatever has not exited. The graphs go before the groups: NCCL frees a communicator only once no
        CUDA graph holds its kernels (`workers` module docstring)."""
        if self._closed:
            return
        healthy = self._failure is None and not self.workers.dead()
        self._closed = True
        try:
            if healthy:
                self._send(StepMessage(Command.SHUTDOWN))
        finally:
            graceful = healthy and self._failure is None
            groups = self.workers.groups
            self.runner.release_graphs()
            close_group(groups.collectives, "collectives", graceful)  # (NCCL: with the workers, at once)
            self.workers.stop(_STOP_TIMEOUT_S)
            close_group(groups.control, "control", graceful)  # once the workers have read SHUTDOWN
            self._finalizer.detach()

    def _order(self, kind: OrderKind, pairs: list[tuple[int, int]]) -> None:
        """Applies the order here at once and queues it for the workers (the same `apply_order` there)."""
        if not pairs:  # (most steps: nothing to apply or send; `execute` checks the workers)
            return
        self._check()
        order = CacheOrder(kind, list(pairs))
        apply_order(self.cache, order)
        self._orders.append(order)

    def _check(self) -> None:
        if self._failure is not None:
            raise WorkerFailedError(self._failure)
        if self._closed:
            raise RuntimeError("the tensor-parallel executor was shut down")
        dead = self.workers.dead()
        if dead:
            raise self._fail(f"tensor-parallel worker rank(s) {dead} exited")

    def _send(self, message: StepMessage) -> None:
        try:
            self._channel.send(message)
        except RuntimeError as exc:
            raise self._fail(f"tensor-parallel step broadcast failed: {exc}") from exc

    def _fail(self, reason: str) -> WorkerFailedError:
        self._failure = reason
        log.error("tensor_parallel.failed", reason=reason)
        self.workers.stop(0.0)  # the survivors cannot go on without the lost rank
        return WorkerFailedError(reason)


def _no_tier_orders(orders: list[Any]) -> list[bytes]:
    """The disk tier's block bytes would need every rank's shard: the builder refuses it under tensor
    parallelism, so a step never has such orders here."""
    if orders:
        raise NotImplementedError("the disk tier is not supported with tensor parallelism")
    return []
