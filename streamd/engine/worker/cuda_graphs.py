"""DecodeGraphs: CUDA graphs of the whole model forward for batches of decode rows, captured at padded sizes.

A row is a decode, or one query token of a speculative verify or a short prompt chunk (`model_runner.decode_rows`).

An eager decode step of a small model is almost all Python and kernel-launch overhead; replaying a graph
launches the same work in one call. Inputs live in static buffers the graphs were captured on; a step
copies its batch into them and replays the graph of the smallest captured size that holds it. Padding
rows have `slot_mapping = -1` (nothing stored) and `seq_len = 0` (nothing read), so they cost almost nothing
and touch no block.

Under tensor parallelism every rank captures its own graphs (`layers_only` on the worker ranks: the decoder
layers without the head, as their eager step) with the row-parallel all-reduces inside them (NCCL
collectives issued on the capturing stream are captured; NCCL >= 2.9). The ranks capture together, size by
size (each size's warm-up forward runs the all-reduces), and `agree` tells whether every rank captured a
size: if one did not, all drop their graphs and run eagerly, so replays always pair up across the ranks.

A graph that captured NCCL kernels holds a reference on their communicator: NCCL destroys (or aborts) a
communicator only once every such graph is gone, and waits for that without limit. So every rank `release`s
its graphs before its process groups go (`workers.close_group`); left to the garbage collector, the
group's destructor ran first whenever the model outlived the runner (the CUDA test kept `runner.graphs`),
and its abort hung the process for good (torch's destructor joins the abort thread after its timeout).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, cast

import torch

from streamd.engine.worker.attention import AttentionMetadata, set_attention_metadata
from streamd.logs import get_logger

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

    from streamd.engine.worker.cache_engine import KVPool
    from streamd.engine.worker.kv_groups import WindowPool

log = get_logger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        ops: ModuleType,
        max_batch: int,
        max_blocks: int,
        layers_only: bool = False,
        window: WindowPool | None = None,
    ) -> None:
        """`window`: the hybrid layout's sliding-layer pool, whose slots and tables get buffers of their own."""
        device = pool.kv_cache.device
        self.window = window
        self.model = model
        self.layers_only = layers_only
        self.pool = pool
        self.ops = ops
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_batch,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((self.max_batch, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(self.max_batch, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(self.max_batch + 1, dtype=torch.int32, device=device)
        if window is not None:  # (the hybrid layout's sliding layers: their own slots and tables)
            self.window_slot_mapping = torch.full_like(self.slot_mapping, -1)
            self.window_block_tables = torch.zeros_like(self.block_tables)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # (layers_only: the final hidden states)
        self.replays = 0  # steps served by a graph (tests and profiling read it)

    def _metadata(self, n: int) -> AttentionMetadata:
        metadata = self._pool_metadata(n, self.pool, self.slot_mapping, self.block_tables)
        window = self.window
        if window is not None:
            metadata.layer_slots = window.groups.layer_slots
            metadata.window = self._pool_metadata(n, window.pool, self.window_slot_mapping, self.window_block_tables)
        return metadata

    def _pool_metadata(
        self, n: int, pool: KVPool, slot_mapping: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        return AttentionMetadata(
            pool.kv_cache,
            slot_mapping[:n],
            block_tables[:n],
            self.seq_lens[:n],
            self.query_start_loc[: n + 1],
            True,
            self.ops,
            kv_scales=pool.kv_scales,
        )

    def _forward(self, n: int) -> torch.Tensor:
        if self.layers_only:
            base = cast(torch.nn.Module, self.model.base_model)
            out = base(input_ids=self.input_ids[None, :n], position_ids=self.positions[None, :n], use_cache=False)
            return out.last_hidden_state[0]
        return self.model(
            input_ids=self.input_ids[None, :n], position_ids=self.positions[None, :n], logits_to_keep=0, use_cache=False
        ).logits[0]

    @torch.inference_mode()
    def capture(self, agree: Callable[[bool], bool] | None = None) -> bool:
        """Captures every size, largest first; False (and no graphs kept) once a size failed here or, with
        `agree` (a tensor-parallel group's vote on this rank's outcome), on any rank."""
        pool = torch.cuda.graph_pool_handle()
        before = torch.cuda.memory_allocated()
        for n in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool memory
            captured = self._capture_one(n, pool)
            if not (captured if agree is None else agree(captured)):
                self.graphs.clear()
                self.logits.clear()
                log.warning("cuda_graphs.abandoned", size=n, reason="a rank failed to capture; decoding eagerly")
                return False
        torch.cuda.synchronize()
        log.info(
            "cuda_graphs.captured",
            sizes=len(self.sizes),
            max_batch=self.max_batch,
            layers_only=self.layers_only,
            mib=round((torch.cuda.memory_allocated() - before) / 2**20, 1),
        )
        return True

    def _capture_one(self, n: int, pool: _POOL_HANDLE) -> bool:
        set_attention_metadata(self._metadata(n))
        try:
            self._forward(n)  # warm-up outside capture (lazy inits, autotuning; the all-reduces run)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (NCCL's watchdog) do not invalidate the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.logits[n] = self._forward(n)
        except RuntimeError as exc:
            log.warning("cuda_graphs.capture_failed", size=n, error=str(exc))
            return False
        finally:
            set_attention_metadata(None)
        self.graphs[n] = graph
        return True

    def release(self) -> None:
        """Destroys the graphs now (their memory and, under tensor parallelism, their hold on the NCCL
        communicator); `replays` stays readable. Called before the process groups are shut down."""
        if not self.graphs:
            return
        torch.cuda.synchronize()  # no replay still running
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.logits.clear()
        torch.cuda.synchronize()  # the graphs' destructors (NCCL's persistent plans) have run

    def size_for(self, num_rows: int) -> int:
        """The captured size that runs a batch of `num_rows` decode rows."""
        return self.sizes[bisect.bisect_left(self.sizes, num_rows)]

    def can_run(self, num_rows: int, max_table_width: int) -> bool:
        return num_rows <= self.max_batch and max_table_width <= self.max_blocks

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        window_slot_mapping: torch.Tensor | None = None,
        window_block_tables: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Device tensors of one batch of decode rows (n; the window pool's too in the hybrid layout); returns
        logits [n, vocab] (layers_only: hidden states). Every rank of a tensor-parallel group picks the same
        size for the same batch (`size_for`)."""
        n = input_ids.shape[0]
        size = self.size_for(n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.block_tables[:n, : block_tables.shape[1]].copy_(block_tables)
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:size].fill_(0)
        if window_slot_mapping is not None and window_block_tables is not None:
            self.window_slot_mapping[:n].copy_(window_slot_mapping)
            self.window_slot_mapping[n:size].fill_(-1)
            self.window_block_tables[:n, : window_block_tables.shape[1]].copy_(window_block_tables)
        self.graphs[size].replay()
        self.replays += 1
        return self.logits[size][:n]
