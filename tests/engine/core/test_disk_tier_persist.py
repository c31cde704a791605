"""The disk tier at a graceful shutdown: the BlockManager lists what the device and the host tier cache, most
valuable first, and the tier keeps the head of that list its bound holds, within a time bound, ranked so a
restarted server evicts the least valuable of them first."""

from __future__ import annotations

from pathlib import Path

from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.disk_tier import _PERSIST_BATCH
from streamd.engine.core.host_tier import HostCache
from streamd.engine.core.kv_tiers import BlockKey, CachedBlock
from streamd.engine.core.prefix_cache import ROOT_HASH
from streamd.engine.core.sequence import Sequence
from tests.engine.core.test_disk_tier import BLOCK_BYTES, BS, computed, key, payload, tier


class Reads:
    """The engine's reads of the pools: each block's bytes; counts what was read, and advances a clock by
    `seconds_per_block` for each block (a slow pool or disk)."""

    def __init__(self, seconds_per_block: float = 0.0) -> None:
        self.blocks: list[BlockKey] = []
        self.now = 0.0
        self.seconds_per_block = seconds_per_block

    def __call__(self, blocks: list[CachedBlock]) -> list[bytes]:
        self.blocks += [b.key for b in blocks]
        self.now += self.seconds_per_block * len(blocks)
        return [payload(b.block) for b in blocks]

    def clock(self) -> float:
        return self.now


def chain(tokens: range) -> list[BlockKey]:
    """The keys of the full blocks of a prompt of `tokens`, each block's parent the one before."""
    keys: list[BlockKey] = []
    for start in range(0, len(tokens) - BS + 1, BS):
        keys.append(key(list(tokens[start : start + BS]), keys[-1].block_hash if keys else ROOT_HASH))
    return keys


def listed(keys: list[BlockKey]) -> list[CachedBlock]:
    return [CachedBlock(k, i) for i, k in enumerate(keys)]


def test_the_bound_keeps_the_head_of_the_list_ranked_newest_after_a_reopen(tmp_path: Path) -> None:
    old = [key([100 + i] * BS) for i in range(3)]
    new = [key([i] * BS) for i in range(5)]
    disk = tier(tmp_path, blocks=4)
    for i, k in enumerate(old):
        disk.put(k, payload(i))
    offered = [new[0], old[2], *new[1:]]  # old[2] is on disk already
    reads = Reads()
    done = disk.persist(listed(offered), reads, timeout_s=60.0)
    assert (done.offered, done.kept, done.written, done.beyond_bound, done.cut_by_deadline) == (6, 1, 3, 2, 0)
    assert reads.blocks == [new[0], new[1], new[2]]  # never what is on disk, never past the bound
    disk.close()
    again = tier(tmp_path, blocks=4)
    assert [again.contains(k) for k in old + new] == [False, False, True, True, True, True, False, False]
    again.put(key([50] * BS), payload(50))
    again.put(key([51] * BS), payload(51))  # the two least valuable go: new[2], then new[1]
    assert [again.contains(k) for k in offered[:4]] == [True, True, False, False]
    again.close()
    reread = tier(tmp_path, blocks=4)
    assert reread.fetch(new[0]) == payload(0) and reread.fetch(old[2]) == payload(2)
    reread.close()


def test_the_time_bound_stops_the_writes_after_the_most_valuable(tmp_path: Path) -> None:
    """Reading a block takes 1 s (a fake clock); the bound allows one batch: the batch at the head of the
    list is written, the rest not; with no time at all nothing is."""
    keys = [key([i % 200, i // 200, 7, 7]) for i in range(_PERSIST_BATCH + 10)]
    disk = tier(tmp_path, blocks=len(keys))
    reads = Reads(seconds_per_block=1.0)
    done = disk.persist(listed(keys), reads, timeout_s=_PERSIST_BATCH + 0.5, clock=reads.clock)
    assert (done.written, done.cut_by_deadline) == (_PERSIST_BATCH, 10)
    assert [disk.contains(k) for k in keys] == [True] * _PERSIST_BATCH + [False] * 10
    late = tier(tmp_path / "late", blocks=len(keys))
    assert late.persist(listed(keys), Reads(), timeout_s=0.0).written == 0
    late.close()
    disk.check_invariants()
    disk.close()
    assert disk.persist(listed(keys), Reads(), timeout_s=60.0).written == 0  # closed: nothing more


def test_persist_order_is_held_then_device_cached_then_host_most_recent_first(tmp_path: Path) -> None:
    disk = tier(tmp_path)
    bm = BlockManager(6, BS, num_swap_blocks=8, watermark=0.0, tier=disk, host_cache=HostCache(BLOCK_BYTES))
    a = computed(bm, list(range(100, 108)))  # 2 full blocks each
    bm.free(a)
    b = computed(bm, list(range(200, 208)))
    bm.free(b)
    c = computed(bm, list(range(300, 316)))  # 4 blocks: evicts a's 2 to the host tier, keeps b's cached
    bm.take_tier_orders()
    order = bm.persist_order()
    assert [x.key for x in order] == chain(range(300, 316)) + chain(range(200, 208)) + chain(range(100, 108))
    assert [x.on_host for x in order] == [False] * 6 + [True] * 2
    again = Sequence(list(range(100, 109)))  # a's prefix, restored from the host tier: listed once, on the device
    bm.free(c)
    again.num_computed_tokens = bm.allocate(again)
    bm.take_tier_orders()
    order = bm.persist_order()
    assert len({x.key for x in order}) == len(order)
    assert {x.key: x.on_host for x in order}[chain(range(100, 108))[0]] is False
    bm.free(again)
    disk.close()
