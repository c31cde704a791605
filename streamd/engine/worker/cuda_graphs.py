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
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, cast

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


class StepTensors(Protocol):
    """What a graph reads of a step (`model_runner.ModelInput` is one; a decode graph's starts and sampling rows are
    its rows, not read)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    sample_idx: torch.Tensor
    window_slot_mapping: torch.Tensor | None
    window_block_tables: torch.Tensor | None


class GraphSet(ABC):
    """What the decode and prefill graphs share: static input buffers of `max_tokens` tokens and `max_seqs`
    sequences (the window pool's too in the hybrid layout), the capture of every size largest first into one
    private memory pool, and `release`. A subclass says what a size's forward is and which metadata it reads."""

    decode_only = True

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        ops: ModuleType,
        sizes: list[int],
        max_seqs: int,
        max_blocks: int,
        window: WindowPool | None = None,
    ) -> None:
        device = pool.kv_cache.device
        self.model, self.pool, self.ops, self.window = model, pool, ops, window
        self.sizes = sizes
        self.max_tokens = sizes[-1]
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((self.max_tokens,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((max_seqs, max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        if window is not None:  # (the hybrid layout's sliding layers: their own slots and tables)
            self.window_slot_mapping = torch.full_like(self.slot_mapping, -1)
            self.window_block_tables = torch.zeros_like(self.block_tables)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # a size's output (decode layers_only: the final hidden states)
        self.replays = 0  # steps served by a graph (tests and profiling read it)

    @abstractmethod
    def _seqs(self, n: int) -> int:
        """The sequences the graph of `n` tokens reads."""

    @abstractmethod
    def _forward(self, n: int) -> torch.Tensor:
        """The forward a size's graph captures, over the static buffers; its output is what a replay returns."""

    def _metadata(self, n: int) -> AttentionMetadata:
        seqs = self._seqs(n)
        metadata = self._pool_metadata(n, seqs, self.pool, self.slot_mapping, self.block_tables)
        window = self.window
        if window is not None:
            metadata.layer_slots = window.groups.layer_slots
            metadata.window = self._pool_metadata(
                n, seqs, window.pool, self.window_slot_mapping, self.window_block_tables
            )
        return metadata

    def _pool_metadata(
        self, n: int, seqs: int, pool: KVPool, slot_mapping: torch.Tensor, block_tables: torch.Tensor
    ) -> AttentionMetadata:
        return AttentionMetadata(
            pool.kv_cache,
            slot_mapping[:n],
            block_tables[:seqs],
            self.seq_lens[:seqs],
            self.query_start_loc[: seqs + 1],
            self.decode_only,
            self.ops,
            kv_scales=pool.kv_scales,
        )

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
                self.outputs.clear()
                log.warning("cuda_graphs.abandoned", kind=self.kind, size=n, reason="a capture failed; running eagerly")
                return False
        torch.cuda.synchronize()
        log.info(
            "cuda_graphs.captured",
            kind=self.kind,
            sizes=len(self.sizes),
            max_tokens=self.max_tokens,
            mib=round((torch.cuda.memory_allocated() - before) / 2**20, 1),
        )
        return True

    @property
    def kind(self) -> str:
        return "decode" if self.decode_only else "prefill"

    def _capture_one(self, n: int, pool: _POOL_HANDLE) -> bool:
        set_attention_metadata(self._metadata(n))
        try:
            self._forward(n)  # warm-up outside capture (lazy inits, autotuning; the all-reduces run)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (NCCL's watchdog) do not invalidate the capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[n] = self._forward(n)
        except RuntimeError as exc:
            log.warning("cuda_graphs.capture_failed", kind=self.kind, size=n, error=str(exc))
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
        self.outputs.clear()
        torch.cuda.synchronize()  # the graphs' destructors (NCCL's persistent plans) have run

    def size_for(self, num_tokens: int) -> int:
        """The captured size that runs a batch of `num_tokens` query tokens."""
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    def run(self, step: StepTensors) -> torch.Tensor:
        """One step in the graph of its size (`load`); its output rows: logits (decode `layers_only`: hidden
        states)."""
        size, rows = self.load(step)
        self.graphs[size].replay()
        self.replays += 1
        return self.outputs[size][:rows]

    def load(self, step: StepTensors) -> tuple[int, int]:
        """`step`'s n tokens and k sequences into the static buffers, padded to its size: padding tokens store
        nothing (slot -1), padding sequences read nothing (length 0); (the size, the output rows: n)."""
        n, k = step.input_ids.shape[0], step.seq_lens.shape[0]
        size = self.size_for(n)
        self.input_ids[:n].copy_(step.input_ids)
        self.positions[:n].copy_(step.positions)
        self._load_slots(self.slot_mapping, step.slot_mapping, size)
        self._load_table(self.block_tables, step.block_tables)
        if step.window_slot_mapping is not None and step.window_block_tables is not None:
            self._load_slots(self.window_slot_mapping, step.window_slot_mapping, size)
            self._load_table(self.window_block_tables, step.window_block_tables)
        self.seq_lens[:k].copy_(step.seq_lens)
        self.seq_lens[k : self._seqs(size)].fill_(0)
        return size, n

    @staticmethod
    def _load_slots(buffer: torch.Tensor, slots: torch.Tensor, size: int) -> None:
        n = slots.shape[0]
        buffer[:n].copy_(slots)
        buffer[n:size].fill_(-1)

    @staticmethod
    def _load_table(buffer: torch.Tensor, tables: torch.Tensor) -> None:
        rows, width = tables.shape
        buffer[:rows, :width].copy_(tables)


class DecodeGraphs(GraphSet):
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
        sizes = capture_sizes(max_batch)
        super().__init__(model, pool, ops, sizes, sizes[-1], max_blocks, window)
        self.layers_only = layers_only

    def _seqs(self, n: int) -> int:
        return n

    def _forward(self, n: int) -> torch.Tensor:
        if self.layers_only:
            base = cast(torch.nn.Module, self.model.base_model)
            out = base(input_ids=self.input_ids[None, :n], position_ids=self.positions[None, :n], use_cache=False)
            return out.last_hidden_state[0]
        return self.model(
            input_ids=self.input_ids[None, :n], position_ids=self.positions[None, :n], logits_to_keep=0, use_cache=False
        ).logits[0]

    def can_run(self, num_rows: int, max_table_width: int) -> bool:
        """Whether a batch of decode rows fits a captured graph (every rank of a tensor-parallel group picks the same
        size for the same batch, `size_for`)."""
        return num_rows <= self.max_tokens and max_table_width <= self.max_blocks


def prefill_capture_sizes(max_tokens: int) -> list[int]:
    """Token counts of the prefill graphs: every 64 to 512, then four a doubling (a step pads by at most 64 tokens
    or a quarter of itself), up to `max_tokens`. A large model's step of a few hundred tokens is bound by its GPU
    work, so its padding costs: an 8B step of 300 tokens took 16.3 ms padded to 512 on an H200 (eagerly 19.3)."""
    sizes, size = [], 64
    while size < max_tokens:
        sizes.append(size)
        size += max(64, 1 << (size.bit_length() - 3))
    return [*sizes, max_tokens]


class PrefillGraphs(GraphSet):
    """CUDA graphs of the whole forward for steps with prompt chunks (prefill metadata: the varlen prefill
    kernel, `query_start_loc`), captured at padded token counts (`prefill_capture_sizes`) for up to `max_seqs`
    sequences. An eager step of such a batch costs ~10 host launches a layer (~40-60 us each on an H200's host):
    ~15 ms at the 8B shape, more than the GPU's work for a few hundred tokens, so a follow-up turn's or a chat's
    first token waited on the host. The prefill kernel's grid needs no host sync (tokens / BLOCK_M + sequences
    tiles), so a step fits a graph once its tokens and sequences are padded: padding sequences have no query
    tokens (`query_start_loc` repeats the last start) and `seq_len = 0`; padding tokens store nothing (`slot_mapping
    = -1`) and no sequence owns them. The logits of the sampling rows (`sample_idx`, padded with row 0) go into one
    buffer all sizes share."""

    decode_only = False

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        ops: ModuleType,
        max_tokens: int,
        max_seqs: int,
        max_blocks: int,
        window: WindowPool | None = None,
    ) -> None:
        super().__init__(model, pool, ops, prefill_capture_sizes(max_tokens), max_seqs, max_blocks, window)
        self.sample_idx = torch.zeros(max_seqs, dtype=torch.int64, device=self.input_ids.device)
        self.logits: torch.Tensor | None = None  # [max_seqs, vocab], every size's output rows

    def _seqs(self, n: int) -> int:
        return min(n, self.max_seqs)  # (a step has at most a sequence a token)

    def _forward(self, n: int) -> torch.Tensor:
        seqs = self._seqs(n)
        logits = self.model(
            input_ids=self.input_ids[None, :n],
            position_ids=self.positions[None, :n],
            logits_to_keep=self.sample_idx[:seqs],
            use_cache=False,
        ).logits[0]
        if self.logits is None:  # the warm-up of the largest size, outside any capture
            self.logits = torch.empty((self.max_seqs, logits.shape[-1]), dtype=logits.dtype, device=logits.device)
        out = self.logits[:seqs]
        out.copy_(logits)
        return out

    def can_run(self, num_tokens: int, num_seqs: int, num_samples: int, max_table_width: int) -> bool:
        """Whether a step fits a captured graph: its tokens, its sequences and its sampling rows (a speculative
        verify samples every query token) within the size's, its tables within the captured width."""
        if not self.graphs or num_tokens > self.max_tokens or max_table_width > self.max_blocks:
            return False
        return max(num_seqs, num_samples) <= self._seqs(self.size_for(num_tokens))

    def load(self, step: StepTensors) -> tuple[int, int]:
        """`step` into the static buffers (`GraphSet.load`), its starts and sampling rows too: padding sequences'
        starts repeat the last (no query tokens), padding sampling rows read row 0; (the size, the sampling rows)."""
        size, n = super().load(step)
        k, m, seqs = step.seq_lens.shape[0], step.sample_idx.shape[0], self._seqs(size)
        self.query_start_loc[: k + 1].copy_(step.query_start_loc)
        self.query_start_loc[k + 1 : seqs + 1].fill_(n)
        self.sample_idx[:m].copy_(step.sample_idx)
        self.sample_idx[m:seqs].fill_(0)
        return size, m
