"""CacheEngine: owns the KV tensors (device pool and host swap pool) and executes the scheduler's swap
and copy orders.

Both pools use the block-major layout of ARCHITECTURE.md,
`[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`, so a block is one contiguous region and
moving k blocks that are adjacent on both sides is one copy. An 8-bit pool (`cache.kv_cache_dtype` int8 or
fp8) keeps each (token, KV head) row's float32 scale in the same block, after the codes (`KVPool`): swap,
copy-on-write and the prefix cache's tiers move a block's bytes as they always did, scales included, and
never look inside. Swaps run on a side stream (CUDA); the compute
stream waits for them before the next forward. `plan_swap` picks how a swap crosses the host link: one
asynchronous copy per run adjacent on both sides when the runs are long, otherwise (on CUDA: a
sequence's blocks scattered over the device pool by decoding beside others, so every run is one block
and per-copy overhead would dominate) a gather into a bounded contiguous device staging buffer and one
copy per host run. A host-tier restore ordered ahead (`swap_in_ahead`) is the exception to "the compute
stream waits": it fills blocks no sequence of the step reads, so it overlaps the step's forward, and an
event recorded after it is what the next step waits on (`join_swaps`, before anything else of that step).
On a CPU-only machine the "device" pool and the swap pool are two separate host
tensors and the same code runs (direct copies unless `direct_run_bytes` is raised, as the tests do).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType

import torch

from streamd.kernels.layout import KV_QUANT_DTYPES, KV_QUANT_NAMES
from streamd.logs import get_logger

log = get_logger(__name__)

# A staged swap moves at most this many bytes per chunk through the device staging buffer: large enough
# that each host copy runs at link speed, small enough to fit in the memory the pool sizing leaves over.
STAGING_BYTES = 64 << 20
# Runs at least this long on average go to the copy engine directly: at ~50 GB/s a copy of 8 MiB takes
# ~160 us, so the few microseconds each copy costs to issue and start are lost in the noise, while
# staging would add a device-side gather of the same bytes.
DIRECT_RUN_BYTES = 8 << 20


def kv_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """`cache.kv_cache_dtype` as the pool's dtype: auto is the model's."""
    return KV_QUANT_NAMES.get(kv_cache_dtype, model_dtype)


@dataclass(slots=True, frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def quantized(self) -> bool:
        """8-bit codes with a float32 scale per (token, KV head) row."""
        return self.dtype in KV_QUANT_DTYPES

    @property
    def code_bytes_per_block(self) -> int:
        return math.prod(self.block_shape()) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def scale_bytes_per_block(self) -> int:
        return math.prod(self.block_shape()[:-1]) * 4 if self.quantized else 0

    @property
    def bytes_per_block(self) -> int:
        """Codes, then scales, rounded up to whole rows of head_dim codes: every block then starts on a row (the
        CPU addresses the pool as rows: `cpu_attention.pool_rows`)."""
        used = self.code_bytes_per_block + self.scale_bytes_per_block
        row = self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        return -(-used // row) * row


@dataclass(frozen=True, slots=True)
class KVPool:
    """One allocation of KV blocks seen three ways: `blocks` [num_blocks, bytes_per_block] uint8, what moves
    (swaps, copy-on-write, the prefix cache's tiers); `kv_cache` [num_blocks, *block_shape] in the pool's dtype,
    what the kernels read and write; and for an 8-bit pool `kv_scales` [num_blocks, num_layers, 2, num_kv_heads,
    block_size] float32, each row's scale, stored in the same block after its codes."""

    blocks: torch.Tensor
    kv_cache: torch.Tensor
    kv_scales: torch.Tensor | None


def allocate_pool(layout: KVLayout, num_blocks: int, device: torch.device | str, pin: bool = False) -> KVPool:
    """`num_blocks` blocks of `layout` (uninitialised), pinned host memory with `pin`."""
    blocks = torch.empty((num_blocks, layout.bytes_per_block), dtype=torch.uint8, device=device, pin_memory=pin)
    return pool_views(blocks, layout)


def pool_views(blocks: torch.Tensor, layout: KVLayout) -> KVPool:
    """The kernels' views of `blocks` [num_blocks, bytes_per_block] (no copy)."""
    num_blocks, codes = blocks.shape[0], layout.code_bytes_per_block
    kv_cache = blocks[:, :codes].view(layout.dtype).view(num_blocks, *layout.block_shape())
    if not layout.quantized:
        return KVPool(blocks, kv_cache, None)
    scales = blocks[:, codes : codes + layout.scale_bytes_per_block]
    kv_scales = scales.view(torch.float32).view(num_blocks, *layout.block_shape()[:-1])
    return KVPool(blocks, kv_cache, kv_scales)


@dataclass(slots=True)
class CopyClock:
    """The bytes and the copy time of the swap-ins (host-tier restores, preempted blocks swapped back): what the
    host link achieves for them (`bytes / seconds`). On CUDA the time is the swap stream's, between events recorded
    around each swap-in's copies (after its wait for the compute stream), read once they completed; on the CPU the
    copies are synchronous and timed on the wall clock."""

    bytes: int = 0
    seconds: float = 0.0
    _pending: deque[tuple[int, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=deque)

    def time(self, num_bytes: int, stream: torch.cuda.Stream | None, copy: Callable[[], None]) -> None:
        """Runs `copy` (its copies queued on `stream`, or synchronous without one) and counts its bytes and time."""
        if stream is None:
            began = time.perf_counter()
            copy()
            self.bytes += num_bytes
            self.seconds += time.perf_counter() - began
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        copy()
        end.record(stream)
        self.settle()
        self._pending.append((num_bytes, start, end))

    def settle(self) -> tuple[int, float]:
        """The totals over the swap-ins finished so far (a pending one is counted once its end event completed)."""
        while self._pending and self._pending[0][2].query():
            num_bytes, start, end = self._pending.popleft()
            self.bytes += num_bytes
            self.seconds += start.elapsed_time(end) / 1e3
        return self.bytes, self.seconds


class CacheEngine:
    def __init__(
        self, layout: KVLayout, num_blocks: int, num_swap_blocks: int, device: torch.device, ops: ModuleType
    ) -> None:
        self.layout = layout
        self.device = device
        self.ops = ops
        pin = device.type == "cuda"
        self.pool = allocate_pool(layout, num_blocks, device)
        self.swap_pool = allocate_pool(layout, num_swap_blocks, "cpu", pin)
        self._swap_stream = torch.cuda.Stream(device) if pin else None
        self._ahead_done: torch.cuda.Event | None = None  # after the last swap-in ahead not yet waited for
        self.restores = CopyClock()  # the swap-ins' bytes and copy time (`CopyClock`)
        # Tunables of `plan_swap` (the swap benchmark sets direct_run_bytes = 0 to measure direct copies).
        # Without CUDA every copy is a plain memcpy with nothing to amortize, and staging would only add a
        # pass over the bytes: direct always (tests raise direct_run_bytes to run the staged path here).
        self.staging_bytes = STAGING_BYTES
        self.direct_run_bytes = DIRECT_RUN_BYTES if pin else 0
        self._kv_rows = _rows(self.pool.blocks)
        self._swap_rows = _rows(self.swap_pool.blocks)
        log.info(
            "kv_cache.allocated",
            num_blocks=num_blocks,
            num_swap_blocks=num_swap_blocks,
            block_size=layout.block_size,
            gib=round(num_blocks * layout.bytes_per_block / 2**30, 3),
            swap_gib=round(num_swap_blocks * layout.bytes_per_block / 2**30, 3),
        )

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.pool.kv_cache

    @property
    def kv_scales(self) -> torch.Tensor | None:
        return self.pool.kv_scales

    @property
    def swap_cache(self) -> torch.Tensor:
        return self.swap_pool.kv_cache

    @property
    def num_blocks(self) -> int:
        return self.pool.blocks.shape[0]

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_pool.blocks.shape[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        self._swap(pairs, to_host=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        self._swap([(d, h) for h, d in pairs], to_host=False)

    def swap_in_ahead(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs into blocks no sequence of this step reads: on the swap stream,
        after the compute work queued so far (the previous forward may still write blocks freed since), with
        no wait of the compute stream, so the copy overlaps this step's forward; `join_swaps` waits for it."""
        self._swap([(d, h) for h, d in pairs], to_host=False, join=False)

    def join_swaps(self) -> None:
        """The compute stream waits for the swap-ins issued ahead (call before a step's first order and its
        forward: they may read or reuse those blocks). Without CUDA every copy is done already."""
        if self._ahead_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._ahead_done)
            self._ahead_done = None

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write orders, (src, dst) device blocks, all layers in one operation."""
        if not pairs:
            return
        src, dst = zip(*pairs)
        index = torch.tensor([src, dst], dtype=torch.int64).to(self.device, non_blocking=True)
        self.ops.copy_blocks(self._kv_rows, index[0], index[1])

    def read_blocks(self, blocks: list[int]) -> list[bytes]:
        """The bytes of each device block (one gather, one copy to the host): a prefix-cache spill."""
        if not blocks:
            return []
        self.join_swaps()  # (a block restored ahead, freed since: at close, after the last step)
        index = torch.tensor(blocks, dtype=torch.int64).to(self.device)
        rows = self.pool.blocks.index_select(0, index).cpu()
        return [row.numpy().tobytes() for row in rows]

    def read_host_blocks(self, blocks: list[int]) -> list[bytes]:
        """The bytes of each host pool block (after the swap copies queued so far): a host-tier block on
        its way to the disk tier."""
        if not blocks:
            return []
        if self._swap_stream is not None:
            self._swap_stream.synchronize()
        rows = self.swap_pool.blocks.index_select(0, torch.tensor(blocks, dtype=torch.int64))
        return [row.numpy().tobytes() for row in rows]

    def write_blocks(self, pairs: list[tuple[int, bytes]]) -> None:
        """(device block, bytes) pairs, as `read_blocks` gave them: a prefix-cache restore."""
        if not pairs:
            return
        blocks, payloads = zip(*pairs, strict=True)
        host = torch.frombuffer(bytearray().join(payloads), dtype=torch.uint8)  # (one copy, writable)
        rows = host.view(len(blocks), self.layout.bytes_per_block)
        index = torch.tensor(blocks, dtype=torch.int64).to(self.device)
        self.pool.blocks.index_copy_(0, index, rows.to(self.device))

    def _swap(self, pairs: list[tuple[int, int]], to_host: bool, join: bool = True) -> None:
        """(device block, host block) pairs, copied in the direction `to_host` says; `join` False: the compute
        stream does not wait (an event marks the copies' end for `join_swaps`)."""
        if not pairs:
            return
        plan = plan_swap(pairs, self.layout.bytes_per_block, self.staging_bytes, self.direct_run_bytes)
        stream = self._swap_stream
        if stream is not None:
            # The swap must see every KV write already queued on the compute stream, and the next forward
            # must see the swap: order both ways.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if to_host:
                self._copy(plan, to_host)
            else:
                self.restores.time(len(pairs) * self.layout.bytes_per_block, stream, lambda: self._copy(plan, False))
        if stream is None:
            return
        if join:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        else:
            self._ahead_done = torch.cuda.Event()
            self._ahead_done.record(stream)

    def _copy(self, plan: SwapPlan, to_host: bool) -> None:
        if plan.chunks is None:
            self._copy_runs(plan.runs, to_host)
        else:
            self._copy_staged(plan.chunks, to_host)

    def _copy_runs(self, runs: list[tuple[int, int, int]], to_host: bool) -> None:
        """One asynchronous copy per (device start, host start, length) run."""
        non_blocking = self._swap_stream is not None
        device_rows, host_rows = self._kv_rows, self._swap_rows
        for d, h, n in runs:
            if to_host:
                host_rows[h : h + n].copy_(device_rows[d : d + n], non_blocking=non_blocking)
            else:
                device_rows[d : d + n].copy_(host_rows[h : h + n], non_blocking=non_blocking)

    def _copy_staged(self, chunks: list[StagedChunk], to_host: bool) -> None:
        """Scattered device blocks go through a contiguous device staging buffer, so the host link sees
        one copy per host run instead of one per block: out = `index_select` gather then D2H copies,
        in = H2D copies then `index_copy_` scatter. Runs on the swap stream (the caller's context)."""
        non_blocking = self._swap_stream is not None
        device_rows, host_rows = self._kv_rows, self._swap_rows
        blocks = [b for chunk in chunks for b in chunk.device_blocks]
        index = torch.tensor(blocks, dtype=torch.int64, pin_memory=non_blocking).to(
            self.device, non_blocking=non_blocking
        )
        start = 0
        for chunk in chunks:
            n = len(chunk.device_blocks)
            idx = index[start : start + n]
            start += n
            # Allocated while the swap stream is current, so the caching allocator hands this memory to
            # the next chunk (or swap) only behind the copies queued here on the same stream: the staging
            # buffer is never overwritten while a copy still reads it, with no event or record_stream.
            staging = torch.empty((n, device_rows.shape[1]), dtype=device_rows.dtype, device=self.device)
            if to_host:
                torch.index_select(device_rows, 0, idx, out=staging)
                for off, h, m in chunk.host_runs:
                    host_rows[h : h + m].copy_(staging[off : off + m], non_blocking=non_blocking)
            else:
                for off, h, m in chunk.host_runs:
                    staging[off : off + m].copy_(host_rows[h : h + m], non_blocking=non_blocking)
                device_rows.index_copy_(0, idx, staging)


def contiguous_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Groups (src, dst) pairs into (src_start, dst_start, length) runs adjacent on both sides."""
    runs: list[tuple[int, int, int]] = []
    s0 = d0 = n = 0
    for s, d in sorted(pairs):  # plain ints in the loop: a swap of 1 GiB is thousands of pairs
        if n and s == s0 + n and d == d0 + n:
            n += 1
        else:
            if n:
                runs.append((s0, d0, n))
            s0, d0, n = s, d, 1
    if n:
        runs.append((s0, d0, n))
    return runs


@dataclass(slots=True, frozen=True)
class StagedChunk:
    """Blocks that pass through the staging buffer together: `device_blocks[i]` is staging row i, and
    each host run (offset in staging, host start, length) is one host<->device copy."""

    device_blocks: list[int]
    host_runs: list[tuple[int, int, int]]


@dataclass(slots=True, frozen=True)
class SwapPlan:
    """Either direct `runs` (device start, host start, length) or staged `chunks` (then `runs` is what
    the direct way would have issued, kept for logs and benchmarks)."""

    runs: list[tuple[int, int, int]]
    chunks: list[StagedChunk] | None = None

    @property
    def num_host_copies(self) -> int:
        return len(self.runs) if self.chunks is None else sum(len(c.host_runs) for c in self.chunks)


def plan_swap(
    pairs: list[tuple[int, int]],
    bytes_per_block: int,
    staging_bytes: int = STAGING_BYTES,
    direct_run_bytes: int = DIRECT_RUN_BYTES,
) -> SwapPlan:
    """(device block, host block) pairs, each block at most once per side -> how to move them.

    Staged when the direct runs are short on average and staging needs fewer operations (host copies
    plus one gather/scatter per chunk); both ways move the same bytes over the link."""
    runs = contiguous_runs(pairs)
    if len(pairs) * bytes_per_block >= direct_run_bytes * len(runs):
        return SwapPlan(runs)
    chunks = staged_chunks(pairs, max(1, staging_bytes // bytes_per_block))
    staged_ops = sum(len(c.host_runs) for c in chunks) + len(chunks)
    if staged_ops >= len(runs):
        return SwapPlan(runs)  # host blocks as scattered as the device ones: staging buys nothing
    return SwapPlan(runs, chunks)


def staged_chunks(pairs: list[tuple[int, int]], max_blocks: int) -> list[StagedChunk]:
    """(device, host) pairs in host order, cut into chunks of at most `max_blocks`; sorting by host block
    turns host blocks handed out in any order (the block manager's free list returns them descending
    after a round trip) into ascending runs."""
    ordered = sorted(pairs, key=lambda p: p[1])
    chunks: list[StagedChunk] = []
    for start in range(0, len(ordered), max_blocks):
        part = ordered[start : start + max_blocks]
        hosts = [h for _, h in part]
        host_runs: list[tuple[int, int, int]] = []
        first = 0
        for offset in range(1, len(hosts) + 1):
            if offset == len(hosts) or hosts[offset] != hosts[offset - 1] + 1:
                host_runs.append((first, hosts[first], offset - first))
                first = offset
        chunks.append(StagedChunk([d for d, _ in part], host_runs))
    return chunks


def _rows(blocks: torch.Tensor) -> torch.Tensor:
    """`blocks` [num_blocks, bytes] in 8-byte words when the block allows, so the copy and gather/scatter
    kernels move a few wide elements instead of many 1-byte ones, whatever the pool's dtype."""
    if blocks.shape[1] % 8 == 0:
        return blocks.view(torch.int64)
    return blocks
