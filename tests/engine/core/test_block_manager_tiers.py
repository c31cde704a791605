"""The BlockManager state machine of test_block_manager.py with both lower tiers on: a host tier in the
swap pool and a disk tier (in memory here). After every call that may order tier moves, the orders run in
the engine's order (reads for the disk first, then the copies into the host pool, then restores), before
the call's own copies; every sequence must still read exactly its own prefixes, through evictions to host
memory, on to disk, and back. Every other admission restores its host hits ahead (as beside other work in
the engine), carried out before the next call as the engine's next step waits for them."""

from __future__ import annotations

import pickle
from typing import Any

from hypothesis import HealthCheck, settings

from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.host_tier import HostCache
from streamd.engine.core.kv_tiers import BlockKey
from streamd.engine.core.sequence import Sequence
from streamd.engine.stats import TierStats
from tests.engine.core.test_block_manager import BS, BlockManagerMachine, ShadowKV, allocate, compute


class MemoryDisk:
    """A disk tier in a dict: the shadow slots of a block, pickled."""

    def __init__(self) -> None:
        self.blocks: dict[BlockKey, bytes] = {}
        self.hits = 0

    def contains(self, key: BlockKey) -> bool:
        return key in self.blocks

    def fetch(self, key: BlockKey) -> bytes | None:
        payload = self.blocks.get(key)
        self.hits += payload is not None
        return payload

    def put(self, key: BlockKey, payload: bytes) -> None:
        self.blocks[key] = payload

    def read_ahead(self, keys: list[BlockKey]) -> bool:
        return False  # (in memory: nothing to read ahead)

    def worth_reading(self) -> bool:
        return True

    def stats(self) -> TierStats:
        return TierStats("disk", len(self.blocks), self.hits, 0, 0)

    def close(self) -> None:
        pass


class TieredManager:
    """The BlockManager, its tier orders carried out on the shadow KV right after each call that plans."""

    PLANNING = frozenset({"allocate", "append_slots", "swap_out", "swap_in", "free", "fork"})

    def __init__(self, bm: BlockManager, kv: ShadowKV, disk: MemoryDisk) -> None:
        self._bm, self._kv, self._disk = bm, kv, disk
        self._admissions = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._bm, name)
        if name not in self.PLANNING:
            return attr

        def planned(*args: Any, **kwargs: Any) -> Any:
            if name == "allocate":
                self._admissions += 1
                kwargs.setdefault("ahead", self._admissions % 2 == 0)
            result = attr(*args, **kwargs)
            self.carry_out()
            return result

        return planned

    def carry_out(self) -> None:
        orders, kv, disk = self._bm.take_tier_orders(), self._kv, self._disk
        if orders is None:
            return
        for block, key in orders.host_to_disk:
            disk.put(key, pickle.dumps(kv.host.get(block)))
        for block, key in orders.spills:
            disk.put(key, pickle.dumps(kv.device.get(block)))
        kv.copy(orders.host_spills, kv.device, kv.host)
        kv.copy(orders.host_restores + orders.host_restores_ahead, kv.host, kv.device)
        for block, payload in orders.restores:
            kv.device[block] = pickle.loads(payload)


class TieredMachine(BlockManagerMachine):
    def __init__(self) -> None:
        super().__init__()
        # A small host pool (swap preemption and the host tier compete for it) and a small device pool
        # (evictions are frequent).
        disk = MemoryDisk()
        bm = BlockManager(16, BS, num_swap_blocks=10, watermark=0.0, tier=disk, host_cache=HostCache(1))
        self.bm = TieredManager(bm, self.kv, disk)  # type: ignore[assignment]


TestTieredMachine = TieredMachine.TestCase
TestTieredMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


def test_the_machine_reaches_both_tiers() -> None:
    """The state machine above is only worth something if restores happen: one scripted run where the
    host pool holds one evicted block and the disk the others, and the prefix comes back from both."""
    kv, disk = ShadowKV(), MemoryDisk()
    bm = TieredManager(BlockManager(4, BS, num_swap_blocks=1, watermark=0.0, tier=disk, host_cache=HostCache(1)),
                       kv, disk)
    prompt = list(range(100, 113))
    first = Sequence(prompt)
    allocate(bm, first)  # type: ignore[arg-type]
    compute(bm, kv, first)  # type: ignore[arg-type]
    bm.free(first)
    other = Sequence(list(range(500, 516)))
    allocate(bm, other)  # type: ignore[arg-type]
    compute(bm, kv, other)  # type: ignore[arg-type]
    bm.free(other)
    again = Sequence(prompt)
    assert allocate(bm, again) == 3 * BS  # type: ignore[arg-type]
    kv.check(again, 3 * BS)
    host, on_disk = bm.stats().tiers
    assert host.hit_blocks >= 1 and on_disk.hit_blocks >= 1
    bm.free(again)
    bm.check_invariants([])


def test_a_sequence_sharing_blocks_restored_ahead_waits_for_them_too() -> None:
    """Two requests with one prefix in the host tier, admitted in one step beside other work: the first's
    host hits are restored ahead into its blocks, the second shares those blocks as prefix hits, and both
    hold blocks still arriving (neither may compute in this step); from the next step neither does, and
    freeing both leaves every block free."""
    bm = BlockManager(4, BS, num_swap_blocks=4, watermark=0.0, host_cache=HostCache(1))
    kv, prompt = ShadowKV(), list(range(100, 100 + 2 * BS + 1))
    first = Sequence(prompt)
    allocate(bm, first)  # type: ignore[arg-type]
    compute(bm, kv, first)  # type: ignore[arg-type]
    bm.free(first)
    evicting = Sequence(list(range(500, 500 + 4 * BS)))
    allocate(bm, evicting)  # type: ignore[arg-type]
    assert len(bm.take_tier_orders().host_spills) == 2  # type: ignore[union-attr]
    bm.free(evicting)
    a, b = Sequence(prompt), Sequence(prompt)
    assert bm.allocate(a, ahead=True) == bm.allocate(b, ahead=True) == 2 * BS
    assert bm.restoring_ahead(a) and bm.restoring_ahead(b) and b.block_table[:2] == a.block_table[:2]
    orders = bm.take_tier_orders()
    assert orders is not None and not orders.host_restores
    assert sorted(d for _, d in orders.host_restores_ahead) == sorted(a.block_table[:2])
    assert not bm.restoring_ahead(a) and not bm.restoring_ahead(b)
    bm.check_invariants([a, b])
    bm.free(a)
    bm.free(b)
    bm.check_invariants([])
    assert bm.num_free_blocks() == 4
