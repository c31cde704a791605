"""CacheEngine: owns the KV tensors (device pool and host swap pool) and executes the scheduler's swap
and copy orders.

Both pools use the block-major layout of ARCHITECTURE.md,
`[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`, so a block is one contiguous region and
moving k blocks that are adjacent on both sides is one copy. Swaps run on a side stream (CUDA) with one
asynchronous copy per contiguous run; the compute stream waits for them before the next forward. On a
CPU-only machine the "device" pool and the swap pool are two separate host tensors and the same code runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType

import torch

from streamd.logs import get_logger

log = get_logger(__name__)


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
    def bytes_per_block(self) -> int:
        return (self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
                * torch.empty((), dtype=self.dtype).element_size())


class CacheEngine:
    def __init__(self, layout: KVLayout, num_blocks: int, num_swap_blocks: int, device: torch.device,
                 ops: ModuleType) -> None:
        self.layout = layout
        self.device = device
        self.ops = ops
        self.kv_cache = torch.empty((num_blocks, *layout.block_shape()), dtype=layout.dtype, device=device)
        pin = device.type == "cuda"
        self.swap_cache = torch.empty((num_swap_blocks, *layout.block_shape()), dtype=layout.dtype,
                                      device="cpu", pin_memory=pin)
        self._swap_stream = torch.cuda.Stream(device) if pin else None
        log.info("kv_cache.allocated", num_blocks=num_blocks, num_swap_blocks=num_swap_blocks,
                 block_size=layout.block_size, gib=round(num_blocks * layout.bytes_per_block / 2**30, 3),
                 swap_gib=round(num_swap_blocks * layout.bytes_per_block / 2**30, 3))

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def num_swap_blocks(self) -> int:
        return self.swap_cache.shape[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, host block) pairs."""
        self._copy_runs(self.kv_cache, self.swap_cache, pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(host block, device block) pairs."""
        self._copy_runs(self.swap_cache, self.kv_cache, pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write orders, (src, dst) device blocks, all layers in one operation."""
        if not pairs:
            return
        src, dst = zip(*pairs)
        index = torch.tensor([src, dst], dtype=torch.int64).to(self.device, non_blocking=True)
        self.ops.copy_blocks(self.kv_cache, index[0], index[1])

    def _copy_runs(self, src_pool: torch.Tensor, dst_pool: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        stream = self._swap_stream
        if stream is not None:
            # The swap must see every KV write already queued on the compute stream, and the next forward
            # must see the swap: order both ways.
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s, d, n in contiguous_runs(pairs):
                dst_pool[d:d + n].copy_(src_pool[s:s + n], non_blocking=stream is not None)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)


def contiguous_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Groups (src, dst) pairs into (src_start, dst_start, length) runs adjacent on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in sorted(pairs):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
