"""The prefix cache's disk tier: files that survive a reopen, the LRU bound, corrupt and foreign files
skipped with a log line (never loaded), and the BlockManager's spills and restores through it."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.disk_tier import DiskTier
from streamd.engine.core.host_tier import HostCache
from streamd.engine.core.kv_tiers import BlockKey, TierOrders
from streamd.engine.core.prefix_cache import ROOT_HASH, PrefixCache, hash_block
from streamd.engine.core.sequence import Sequence

BS = 4
BLOCK_BYTES = 64
LAYOUT = "test-layout"


def key(tokens: list[int], parent: int = ROOT_HASH) -> BlockKey:
    return BlockKey(hash_block(parent, tokens), parent, tuple(tokens))


def payload(i: int) -> bytes:
    return bytes((i + j) % 256 for j in range(BLOCK_BYTES))


def tier(directory: Path, blocks: int = 100, layout: str = LAYOUT, recompute_s: float | None = None) -> DiskTier:
    entry = 48 + 8 * BS + BLOCK_BYTES  # header + token ids + payload
    return DiskTier(directory, blocks * entry, layout, BLOCK_BYTES, recompute_s)


def file_of(disk: DiskTier, k: BlockKey) -> Path:
    return disk.directory / f"{k.block_hash:016x}.kv"


def test_blocks_survive_a_reopen(tmp_path: Path) -> None:
    keys = [key([i, i + 1, i + 2, i + 3]) for i in range(3)]
    disk = tier(tmp_path)
    for i, k in enumerate(keys):
        disk.put(k, payload(i))
    assert disk.fetch(keys[0]) == payload(0)  # before its file is written: from memory
    disk.close()
    again = tier(tmp_path)
    assert [again.fetch(k) for k in keys] == [payload(i) for i in range(3)]
    assert again.fetch(key([9, 9, 9, 9])) is None
    collided = BlockKey(keys[1].block_hash, keys[1].parent_hash, (7, 7, 7, 7))  # same hash, other tokens
    assert not again.contains(collided) and again.fetch(collided) is None
    stats = again.stats()
    assert (stats.blocks, stats.hit_blocks, stats.skipped_files) == (3, 3, 0)
    again.close()


def test_the_bound_evicts_the_least_recently_used(tmp_path: Path) -> None:
    a, b, c = (key([i] * BS) for i in (1, 2, 3))
    disk = tier(tmp_path, blocks=2)
    disk.put(a, payload(1))
    disk.put(b, payload(2))
    assert disk.fetch(a) is not None  # a is now the most recently used
    disk.put(c, payload(3))
    disk.flush()
    assert disk.contains(a) and disk.contains(c) and not disk.contains(b)
    assert not file_of(disk, b).exists() and file_of(disk, a).exists()
    disk.close()


def test_a_block_evicted_and_put_back_before_the_writer_caught_up_keeps_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer is behind: `a` is written, evicted (its delete queued) and put back before the first job
    ran, so that job writes the new bytes; the queued delete must not remove them."""
    a, b = key([1] * BS), key([2] * BS)
    disk = tier(tmp_path, blocks=1)
    behind, do = threading.Event(), disk._do

    def late_first_job(*job: object) -> None:
        behind.wait(5)
        do(*job)  # type: ignore[arg-type]

    monkeypatch.setattr(disk, "_do", late_first_job)
    disk.put(a, payload(1))
    disk.put(b, payload(2))  # evicts a
    disk.put(a, payload(3))  # evicts b, a is back
    behind.set()
    disk.check_invariants()  # (waits for the writer)
    assert file_of(disk, a).exists() and disk.fetch(a) == payload(3)
    disk.close()


def test_truncated_and_foreign_files_are_skipped_with_a_log_line(tmp_path: Path) -> None:
    good, cut, alien = key([1] * BS), key([2] * BS), key([3] * BS)
    disk = tier(tmp_path)
    disk.put(good, payload(1))
    disk.put(cut, payload(2))
    disk.close()
    other = tier(tmp_path, layout="another model")
    other.put(alien, payload(3))
    other.close()
    os.replace(file_of(other, alien), file_of(disk, alien))  # a foreign file in this layout's directory
    with file_of(disk, cut).open("r+b") as f:
        f.truncate(100)
    with capture_logs() as logs:
        again = tier(tmp_path)
    skipped = {Path(e["path"]).name: e["reason"] for e in logs if e["event"] == "disk_tier.file_skipped"}
    assert skipped.keys() == {file_of(disk, cut).name, file_of(disk, alien).name}
    assert "foreign" in skipped[file_of(disk, alien).name] and "truncated" in skipped[file_of(disk, cut).name]
    assert again.fetch(good) == payload(1)
    assert again.fetch(cut) is None and again.fetch(alien) is None
    assert again.stats().skipped_files == 2
    again.close()


def test_a_tampered_payload_is_never_loaded(tmp_path: Path) -> None:
    k = key([5] * BS)
    disk = tier(tmp_path)
    disk.put(k, payload(5))
    disk.close()
    data = bytearray(file_of(disk, k).read_bytes())
    data[-1] ^= 0xFF
    file_of(disk, k).write_bytes(bytes(data))
    again = tier(tmp_path)
    assert again.contains(k)  # the header is intact: only the checksum can tell
    with capture_logs() as logs:
        assert again.fetch(k) is None
    assert [e["reason"] for e in logs if e["event"] == "disk_tier.file_skipped"] == [
        "payload checksum mismatch (tampered or corrupt)"
    ]
    again.flush()
    assert not again.contains(k) and not file_of(again, k).exists()
    again.close()


def test_read_only_where_it_beats_recomputing(tmp_path: Path) -> None:
    slow_recompute, instant_recompute = tier(tmp_path, recompute_s=10.0), tier(tmp_path / "b", recompute_s=0.0)
    assert slow_recompute.worth_reading() and not instant_recompute.worth_reading()
    slow_recompute.close()
    instant_recompute.close()


def test_a_slow_spell_does_not_shut_the_tier_for_good(tmp_path: Path) -> None:
    """Reads are measured only when they happen: after a slow read closed the gate, every 64th admission
    reads anyway, and fast reads there open it again."""
    disk = tier(tmp_path, recompute_s=1.0)
    k = key([1, 2, 3, 4])
    disk.put(k, payload(1))
    disk.flush()
    disk.read_s_per_block = 10.0  # as after a read during a stall
    with capture_logs() as logs:
        answers = [disk.worth_reading() for _ in range(128)]
        assert answers.count(True) == 2 and answers[63] and answers[127]
        for _ in range(12):  # the reads the gate lets through are measured (~ms) and weighed in
            assert disk.fetch(k) == payload(1)
        assert disk.read_s_per_block < 1.0
        assert all(disk.worth_reading() for _ in range(10))
    changes = [(e["event"], e["recompute_ms_per_block"]) for e in logs if e["event"].startswith("disk_tier.reading")]
    assert changes == [("disk_tier.reading_off", 1000.0), ("disk_tier.reading_on", 1000.0)]  # (each change once)
    disk.close()


def computed(bm: BlockManager, tokens: list[int]) -> Sequence:
    """A sequence allocated and wholly computed (its full blocks registered)."""
    seq = Sequence(tokens)
    seq.num_computed_tokens = bm.allocate(seq)
    seq.num_computed_tokens = len(tokens)
    bm.mark_computed(seq)
    return seq


def taken(bm: BlockManager) -> TierOrders:
    """The step's tier orders, which must hold some."""
    orders = bm.take_tier_orders()
    assert orders is not None
    return orders


def test_evicted_blocks_spill_and_a_returning_prefix_is_restored(tmp_path: Path) -> None:
    disk = tier(tmp_path)
    bm = BlockManager(4, BS, watermark=0.0, tier=disk)
    prompt = list(range(100, 113))  # 3 full blocks + 1 token
    first = computed(bm, prompt)
    table = list(first.block_table)
    bytes_of = {block: payload(block) for block in table}  # what the device holds
    bm.free(first)
    assert bm.take_tier_orders() is None  # freed cached blocks stay on the device
    other = computed(bm, list(range(500, 516)))  # takes all 4 blocks: evicts the 3 cached ones
    spills = taken(bm).spills
    assert sorted(b for b, _ in spills) == sorted(table[:3])
    for block, k in spills:  # what the engine does with the orders
        disk.put(k, bytes_of[block])
    bm.free(other)
    again = Sequence(prompt)
    again.num_computed_tokens = cached = bm.allocate(again)
    assert cached == 3 * BS
    restores = taken(bm).restores
    assert restores == [(again.block_table[i], bytes_of[table[i]]) for i in range(3)]
    assert bm.stats().device_hit_blocks == 0 and bm.stats().tiers[0].hit_blocks == 3
    assert set(bm.findable_blocks().values()) >= set(again.block_table[:3])  # restored blocks are findable
    bm.check_invariants([again])
    bm.free(again)
    bm.check_invariants([])
    disk.close()


def test_without_a_tier_eviction_and_steps_cost_no_tier_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiers off (the default on the CPU): evicting a cached block builds no key, and no step carries
    orders."""

    def no_key(cache: PrefixCache, block: int) -> BlockKey | None:
        raise AssertionError("a block key was built without a tier")

    monkeypatch.setattr(PrefixCache, "key_of", no_key)
    bm = BlockManager(4, BS, watermark=0.0)
    bm.free(computed(bm, list(range(100, 113))))
    assert bm.stats().blocks_cached == 3
    other = computed(bm, list(range(500, 516)))  # evicts the 3 cached blocks
    assert bm.stats().blocks_cached == 0 and bm.take_tier_orders() is None
    bm.free(other)


def test_the_chain_stops_at_the_first_block_the_tier_lacks(tmp_path: Path) -> None:
    disk = tier(tmp_path)
    prompt = list(range(200, 213))
    h0 = hash_block(ROOT_HASH, prompt[:4])
    h1 = hash_block(h0, prompt[4:8])
    disk.put(BlockKey(h0, ROOT_HASH, tuple(prompt[:4])), payload(0))
    disk.put(BlockKey(hash_block(h1, prompt[8:12]), h1, tuple(prompt[8:12])), payload(2))  # block 1 missing
    bm = BlockManager(8, BS, watermark=0.0, tier=disk)
    seq = Sequence(prompt)
    assert bm.allocate(seq) == BS
    assert [p for _, p in taken(bm).restores] == [payload(0)]
    bm.free(seq)
    bm.check_invariants([])
    disk.close()


def test_no_restore_where_recomputing_is_cheaper_or_prompt_logprobs_are_asked(tmp_path: Path) -> None:
    prompt = list(range(300, 309))
    disk = tier(tmp_path, recompute_s=0.0)
    disk.put(key(prompt[:4]), payload(0))
    bm = BlockManager(8, BS, watermark=0.0, tier=disk)
    seq = Sequence(prompt)
    assert bm.allocate(seq) == 0 and bm.take_tier_orders() is None
    disk.recompute_s_per_block = None
    other = Sequence(prompt)
    assert bm.allocate(other, reuse_prefix=False) == 0 and bm.take_tier_orders() is None
    bm.free(seq)
    bm.free(other)
    disk.close()


# ---- the host-RAM tier (in the swap pool) above the disk tier --------------------------------------------


def test_host_tier_takes_evicted_blocks_and_gives_them_back() -> None:
    host = HostCache(BLOCK_BYTES)
    bm = BlockManager(4, BS, num_swap_blocks=4, watermark=0.0, host_cache=host)
    prompt = list(range(100, 113))
    first = computed(bm, prompt)
    table = list(first.block_table)
    bm.free(first)
    other = computed(bm, list(range(500, 516)))  # evicts the 3 cached device blocks to the host tier
    orders = taken(bm)
    assert sorted(d for d, _ in orders.host_spills) == sorted(table[:3]) and not orders.spills
    where = dict(orders.host_spills)  # device block -> host block
    bm.free(other)
    again = Sequence(prompt)
    again.num_computed_tokens = bm.allocate(again)
    assert again.num_computed_tokens == 3 * BS
    assert taken(bm).host_restores == [(where[table[i]], again.block_table[i]) for i in range(3)]
    assert bm.stats().tiers[0].name == "host" and bm.stats().tiers[0].hit_blocks == 3
    bm.check_invariants([again])
    bm.free(again)
    bm.check_invariants([])
    assert bm.stats().swap_blocks_free == 4  # cached host blocks count as free for swap preemption


def test_swap_preemption_takes_cached_host_blocks_first_and_they_go_to_disk(tmp_path: Path) -> None:
    disk = tier(tmp_path)
    bm = BlockManager(4, BS, num_swap_blocks=3, watermark=0.0, tier=disk, host_cache=HostCache(BLOCK_BYTES))
    first = computed(bm, list(range(100, 113)))
    bm.free(first)
    other = computed(bm, list(range(500, 516)))  # the host pool is now all cached prefix blocks
    cached = {h for _, h in taken(bm).host_spills}
    assert bm.num_free_swap_blocks() == 3 and bm.can_swap_out([other]) is False  # 4 blocks > 3
    victim = Sequence(list(range(700, 712)))  # 3 blocks
    bm.free(other)
    victim.num_computed_tokens = bm.allocate(victim)
    bm.take_tier_orders()
    assert bm.can_swap_out([victim])
    pairs = bm.swap_out([victim])
    orders = taken(bm)
    assert sorted(h for _, h in pairs) == sorted(cached)  # the cached host blocks were taken
    assert sorted(h for h, _ in orders.host_to_disk) == sorted(cached)  # and their content goes to disk
    bm.check_invariants([victim])
    bm.free(victim)
    bm.take_tier_orders()
    bm.check_invariants([])
    disk.close()


def test_other_layouts_files_count_toward_the_bound_and_go_first(tmp_path: Path) -> None:
    """Another model's files in the same directory: beyond the bound at start, the oldest go at once (with a
    log line); the rest go before any of this layout's own blocks as it fills up."""
    old = tier(tmp_path, layout="the previous model")
    old_keys = [key([i] * BS) for i in range(4)]
    for i, k in enumerate(old_keys):
        old.put(k, payload(i))
        old.flush()
        os.utime(file_of(old, k), ns=(i * 10**9, i * 10**9))  # oldest first
    old.close()
    with capture_logs() as logs:
        disk = tier(tmp_path, blocks=3)
    assert [(e["files"], e["evicted"]) for e in logs if e["event"] == "disk_tier.other_layouts"] == [(4, 1)]
    disk.flush()
    assert [file_of(old, k).exists() for k in old_keys] == [False, True, True, True]
    own = [key([9, i, i, i]) for i in range(3)]
    for i, k in enumerate(own[:2]):
        disk.put(k, payload(i))
    disk.flush()
    assert [file_of(old, k).exists() for k in old_keys] == [False, False, False, True]
    disk.put(own[2], payload(2))
    disk.flush()
    assert not any(file_of(old, k).exists() for k in old_keys)
    assert all(disk.contains(k) and file_of(disk, k).exists() for k in own)
    disk.check_invariants()
    disk.close()
