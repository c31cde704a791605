"""HostCache: the prefix cache's host-RAM tier, kept in the host swap pool's free blocks (issue 31).

On a GPU, a block the device LRU evicts is copied to a host block of the swap pool (the same block-major
layout, batched copies) and indexed here by its `BlockKey`; admission's chain continues here after the
device's, and a hit is copied back before the forward, like a swap-in. The BlockManager owns the host pool
(reference counts, free list); this index owns which free host blocks still hold a findable block, least
recently used first. Swap preemption keeps priority: a swap-out that finds no free host block takes the
least recently used cached one (which then goes on to the disk tier, if any). Hits are taken only while the
host link beats recomputing (`worth_reading`, from the preemption cost model). Plain Python, no torch.
"""

from __future__ import annotations

from collections import OrderedDict

from streamd.engine.core.kv_tiers import BlockKey
from streamd.engine.stats import TierStats


class HostCache:
    def __init__(self, bytes_per_block: int, worth_reading: bool = True) -> None:
        self.bytes_per_block = bytes_per_block
        self.reading_pays = worth_reading
        self._by_hash: dict[int, int] = {}  # block hash -> host block
        self._keys: dict[int, BlockKey] = {}  # host block -> its content's key
        self._lru: OrderedDict[int, None] = OrderedDict()  # unpinned cached host blocks, least recent first
        self.hit_blocks = self.spilled_blocks = 0

    def lookup(self, key: BlockKey) -> int | None:
        block = self._by_hash.get(key.block_hash)
        return block if block is not None and self._keys[block] == key else None

    def add(self, block: int, key: BlockKey) -> None:
        self.remove(self._by_hash.get(key.block_hash, -1))  # a colliding hash: the newer content wins
        self._by_hash[key.block_hash] = block
        self._keys[block] = key
        self._lru[block] = None
        self.spilled_blocks += 1

    def pin(self, block: int, hit: bool = True) -> None:
        """A block copied in or out in this step (a hit, or one just spilled here): not evictable until
        `unpin`, so no other order of the step reads or overwrites it before its copy ran."""
        del self._lru[block]
        self.hit_blocks += hit

    def unpin(self, block: int) -> None:
        if block in self._keys:
            self._lru[block] = None  # now the most recently used

    def evict(self) -> tuple[int, BlockKey] | None:
        """The least recently used unpinned cached block, forgotten; None when there is none."""
        if not self._lru:
            return None
        block, _ = self._lru.popitem(last=False)
        key = self._keys.pop(block)
        del self._by_hash[key.block_hash]
        return block, key

    def remove(self, block: int) -> None:
        key = self._keys.pop(block, None)
        if key is not None:
            del self._by_hash[key.block_hash]
            self._lru.pop(block, None)

    def contains(self, key: BlockKey) -> bool:
        return self.lookup(key) is not None

    def worth_reading(self) -> bool:
        return self.reading_pays

    def evictable(self) -> int:
        return len(self._lru)

    def cached_blocks(self) -> list[int]:
        """Every unpinned cached host block (free for swap preemption), least recently used first."""
        return list(self._lru)

    def key_of(self, block: int) -> BlockKey:
        return self._keys[block]

    def stats(self) -> TierStats:
        moved = self.bytes_per_block
        return TierStats("host", len(self._keys), self.hit_blocks, self.hit_blocks * moved, self.spilled_blocks * moved)
