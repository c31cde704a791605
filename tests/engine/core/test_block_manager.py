"""BlockManager: unit tests and a hypothesis state machine over a shadow KV cache.

The shadow stores, in every slot a sequence writes, the token prefix that produced it (what a real KV
entry depends on). Whatever the block manager does (prefix hits, copy-on-write, swap, eviction), reading a
sequence's computed positions through its page table must give back exactly its own prefixes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamd.engine.core.block_manager import BlockManager
from streamd.engine.core.prefix_cache import ROOT_HASH, PrefixCache, SeqHashes, hash_block
from streamd.engine.core.sequence import Sequence

BS = 4


class ShadowKV:
    """What the CacheEngine would hold: device and host slots, moved by the manager's orders."""

    def __init__(self) -> None:
        self.device: dict[int, list[tuple[int, ...] | None]] = {}
        self.host: dict[int, list[tuple[int, ...] | None]] = {}

    def write(self, seq: Sequence, start: int, stop: int) -> None:
        for pos in range(start, stop):
            block = seq.block_table[pos // BS]
            self.device.setdefault(block, [None] * BS)[pos % BS] = tuple(seq.token_ids[:pos + 1])

    def check(self, seq: Sequence, stop: int) -> None:
        for pos in range(stop):
            slots = self.device.get(seq.block_table[pos // BS])
            got = slots[pos % BS] if slots else None
            assert got == tuple(seq.token_ids[:pos + 1]), f"seq {seq.seq_id} reads wrong KV at {pos}"

    def copy(self, pairs, src: dict, dst: dict) -> None:
        for a, b in pairs:
            dst[b] = list(src.get(a, [None] * BS))


def allocate(bm: BlockManager, seq: Sequence) -> int:
    """As the scheduler admits a sequence: blocks for its tokens, the cached ones counted as computed."""
    seq.num_computed_tokens = cached = bm.allocate(seq)
    return cached


def fork(bm: BlockManager, parent: Sequence) -> Sequence:
    """As the scheduler forks a sequence: the child continues the parent's tokens, KV and blocks."""
    child = parent.fork()
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    return child


def compute(bm: BlockManager, kv: ShadowKV, seq: Sequence, n: int | None = None) -> None:
    """A forward over the next n uncomputed tokens (all by default)."""
    start = seq.num_computed_tokens
    stop = seq.num_tokens if n is None else min(seq.num_tokens, start + n)
    kv.check(seq, start)
    kv.write(seq, start, stop)
    seq.num_computed_tokens = stop
    bm.mark_computed(seq)


def test_allocate_covers_prompt_and_counts():
    bm = BlockManager(10, BS, watermark=0.0)
    seq = Sequence(list(range(9)))
    assert bm.blocks_needed(9) == 3 and bm.can_allocate([seq])
    assert allocate(bm, seq) == 0
    assert len(seq.block_table) == 3 and bm.num_free_blocks() == 7
    bm.free(seq)
    assert bm.num_free_blocks() == 10 and seq.block_table == []
    bm.check_invariants([])


def test_watermark_and_can_ever_fit():
    bm = BlockManager(100, BS, watermark=0.1)
    assert bm.watermark_blocks == 10
    assert bm.can_ever_fit(90 * BS) and not bm.can_ever_fit(90 * BS + 1)
    hog = Sequence(list(range(80 * BS)))
    allocate(bm, hog)
    assert bm.can_allocate([Sequence(list(range(10 * BS)))])  # 20 free - 10 = 10 >= 10
    assert not bm.can_allocate([Sequence(list(range(10 * BS + 1)))])  # 20 - 11 < 10
    assert bm.can_allocate([Sequence(list(range(10 * BS + 1)))], reserve=0)


def test_prefix_hit_only_after_kv_written_and_never_whole_prompt():
    bm, kv = BlockManager(20, BS, watermark=0.0), ShadowKV()
    first = Sequence(list(range(12)))
    allocate(bm, first)
    twin = Sequence(list(range(12)))
    assert allocate(bm, twin) == 0  # nothing written yet: nothing findable
    bm.free(twin)
    compute(bm, kv, first, 8)  # two blocks written
    third = Sequence(list(range(12)))
    assert allocate(bm, third) == 8  # the third block is not written yet
    assert third.block_table[:2] == first.block_table[:2]
    compute(bm, kv, first)
    fourth = Sequence(list(range(12)))
    # All 12 tokens are cached, but the last one must be computed: its block is recomputed.
    # The scheduler, not the block manager, makes the cached count the sequence's num_computed_tokens.
    assert bm.allocate(fourth) == 8 and fourth.num_computed_tokens == 0
    assert bm.stats().prefix_hit_tokens == 16
    assert bm.stats().prefix_queried_tokens == 48


def test_freed_blocks_stay_findable_and_evict_least_recently_freed():
    bm, kv = BlockManager(6, BS, watermark=0.0), ShadowKV()
    a, b = Sequence([1] * 8 + [9]), Sequence([2] * 8 + [9])
    for seq in (a, b):
        allocate(bm, seq)
        compute(bm, kv, seq)
    a_blocks, b_blocks = a.block_table[:2], b.block_table[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks() == 6 and len(bm.findable_blocks()) == 4
    # Two unregistered blocks go first, then a's blocks (freed before b's), tail block first.
    hog = Sequence(list(range(100, 100 + 3 * BS)))
    allocate(bm, hog)
    assert a_blocks[1] in hog.block_table and a_blocks[0] not in hog.block_table
    assert set(b_blocks) == set(bm.findable_blocks().values()) - {a_blocks[0]}
    again = Sequence([2] * 8 + [5])
    assert allocate(bm, again) == 8 and again.block_table[:2] == b_blocks


def test_fork_shares_and_copy_on_write():
    bm, kv = BlockManager(10, BS, watermark=0.0), ShadowKV()
    parent = Sequence([7, 8, 9, 10, 11, 12])
    allocate(bm, parent)
    compute(bm, kv, parent)
    child = fork(bm, parent)
    assert child.block_table == parent.block_table
    assert all(bm.ref_count(b) == 2 for b in parent.block_table)
    parent.append_token(1)
    child.append_token(2)
    assert bm.blocks_to_append_all([parent, child]) == 1  # the last writer keeps the block
    copies = bm.append_slots(parent)
    assert len(copies) == 1 and copies[0][0] == child.block_table[1]
    kv.copy(copies, kv.device, kv.device)
    assert bm.append_slots(child) == ()  # refcount is back to 1: child writes in place
    compute(bm, kv, parent)
    compute(bm, kv, child)
    kv.check(parent, parent.num_tokens)
    kv.check(child, child.num_tokens)
    bm.check_invariants([parent, child])


def test_swap_round_trip_and_cached_reuse():
    bm, kv = BlockManager(8, BS, num_swap_blocks=8, watermark=0.0), ShadowKV()
    seq = Sequence(list(range(10)))
    allocate(bm, seq)
    compute(bm, kv, seq)
    assert bm.can_swap_out([seq])
    out = bm.swap_out([seq])
    kv.copy(out, kv.device, kv.host)
    assert seq.block_table == [] and bm.num_free_blocks() == 8 and bm.num_free_swap_blocks() == 5
    assert bm.stats().swapped_out_blocks == 3
    seq.append_token(3)
    assert bm.blocks_to_swap_in([seq]) == 3  # two full blocks + the partial one (room for token 11)
    back = bm.swap_in([seq])
    kv.copy(back, kv.host, kv.device)
    # The two full blocks were still cached on the device: only the partial block crossed the link.
    assert len(back) == 1 and bm.stats().swapped_in_blocks == 1
    bm.append_slots(seq)
    compute(bm, kv, seq)
    kv.check(seq, seq.num_tokens)
    bm.free(seq)
    bm.check_invariants([])
    assert bm.num_free_swap_blocks() == 8


def test_swap_in_reserves_exactly_the_copy_on_write_of_a_shared_last_block():
    bm, kv = BlockManager(8, BS, num_swap_blocks=8, watermark=0.0), ShadowKV()
    parent = Sequence([1, 2, 3, 4, 5, 6])
    allocate(bm, parent)
    compute(bm, kv, parent)
    child = fork(bm, parent)
    parent.append_token(7)
    child.append_token(8)  # both will write slot 6, in the block they share
    kv.copy(bm.swap_out([parent, child]), kv.device, kv.host)
    assert bm.num_free_swap_blocks() == 6  # shared blocks cross once
    assert bm.blocks_to_swap_in([parent, child]) == 3  # 2 blocks + 1 copy (the last writer keeps it)
    filler = Sequence(list(range(100, 100 + 5 * BS)))
    allocate(bm, filler)
    assert bm.num_free_blocks() == 3 and bm.can_swap_in([parent, child], reserve=0)
    kv.copy(bm.swap_in([parent, child]), kv.host, kv.device)
    for seq in (parent, child):
        kv.copy(bm.append_slots(seq), kv.device, kv.device)
        compute(bm, kv, seq)
        kv.check(seq, seq.num_tokens)
    assert bm.num_free_blocks() == 0
    bm.check_invariants([parent, child, filler])


def test_swap_in_reserves_the_next_block_of_a_decoding_sequence():
    bm, kv = BlockManager(4, BS, num_swap_blocks=4, watermark=0.0, enable_prefix_caching=False), ShadowKV()
    seq = Sequence([1, 2, 3, 4])
    allocate(bm, seq)
    compute(bm, kv, seq)
    seq.append_token(5)  # its slot is in a block it does not have yet
    kv.copy(bm.swap_out([seq]), kv.device, kv.host)
    allocate(bm, Sequence(list(range(100, 100 + 2 * BS))))
    assert bm.blocks_to_swap_in([seq]) == 2 and bm.can_swap_in([seq], reserve=0)
    allocate(bm, Sequence([9]))
    assert not bm.can_swap_in([seq], reserve=0)  # 1 free: the block fits, its next slot would not


def test_hash_collision_is_rejected_by_token_comparison():
    cache = PrefixCache(4)
    h = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert cache.register(2, h, ROOT_HASH, [1, 2, 3, 4])
    assert cache.lookup(h, ROOT_HASH, [1, 2, 3, 4]) == 2
    assert cache.lookup(h, ROOT_HASH, [4, 3, 2, 1]) is None  # same hash, other tokens
    assert cache.lookup(h, 12345, [1, 2, 3, 4]) is None  # same tokens after another prefix
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(hash_block(ROOT_HASH, [0]), [1, 2])
    # A sequence's chain records each block's real parent, so a hit is confirmed against it too.
    chain = SeqHashes(2)
    tokens = [5, 6, 7, 8]
    assert chain.block_hash(tokens, 1) == hash_block(hash_block(ROOT_HASH, [5, 6]), [7, 8])
    assert chain.parent(0) == ROOT_HASH and chain.parent(1) == chain.hashes[0]


def test_prefix_caching_off_registers_nothing():
    bm, kv = BlockManager(8, BS, watermark=0.0, enable_prefix_caching=False), ShadowKV()
    seq = Sequence(list(range(9)))
    allocate(bm, seq)
    compute(bm, kv, seq)
    assert bm.findable_blocks() == {}
    assert allocate(bm, Sequence(list(range(9)))) == 0


def test_invariant_checker_catches_a_leak():
    bm = BlockManager(4, BS)
    seq = Sequence([1, 2, 3])
    allocate(bm, seq)
    with pytest.raises(AssertionError):
        bm.check_invariants([])  # the sequence's block is neither free nor accounted for


# ---- the state machine ------------------------------------------------------------------------

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 50, 60, 70, 80], [11, 12, 13, 14, 15, 16, 17, 18]]


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(16, BS, num_swap_blocks=10, watermark=0.0)
        self.kv = ShadowKV()
        self.live: list[Sequence] = []
        self.swapped: list[list[Sequence]] = []

    def _pick(self, seqs: list[Sequence], i: int) -> Sequence:
        return seqs[i % len(seqs)]

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(0, 9),
          suffix=st.lists(st.integers(0, 20), max_size=6))
    def new_seq(self, prefix: int, cut: int, suffix: list[int]) -> None:
        seq = Sequence(PREFIXES[prefix][:cut] + suffix or [0])
        if not self.bm.can_allocate([seq]):
            self.bm.free(seq)  # drops the hashes can_allocate computed
            return
        cached = allocate(self.bm, seq)
        assert cached % BS == 0 and cached < seq.num_tokens
        self.kv.check(seq, cached)  # a prefix hit hands over exactly this sequence's KV
        self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, 12))
    def compute(self, i: int, n: int) -> None:
        """A prompt chunk (its blocks were allocated whole); decodes go through `decode`."""
        seq = self._pick(self.live, i)
        if seq.num_tokens - seq.num_computed_tokens > 1:
            compute(self.bm, self.kv, seq, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), token=st.integers(0, 20))
    def sample(self, i: int, token: int) -> None:
        """The engine appends a sampled token; its slot is found at the next step."""
        seq = self._pick(self.live, i)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def decode(self, i: int) -> None:
        seq = self._pick(self.live, i)
        if seq.num_tokens - seq.num_computed_tokens == 1 and self.bm.blocks_to_append_all([seq]) <= self.bm.num_free_blocks():
            self.kv.copy(self.bm.append_slots(seq), self.kv.device, self.kv.device)
            compute(self.bm, self.kv, seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        parent = self._pick(self.live, i)
        if parent.num_tokens - parent.num_computed_tokens > 1:
            with pytest.raises(ValueError, match="prefilling"):
                self.bm.fork(parent, parent.fork())
            return
        child = fork(self.bm, parent)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def recompute(self, i: int) -> None:
        seq = self._pick(self.live, i)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        if self.bm.can_allocate([seq], reserve=0):
            cached = allocate(self.bm, seq)
            self.kv.check(seq, cached)
        else:
            self.bm.free(seq)
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def swap_out(self, i: int) -> None:
        """A sequence and the live ones sharing a block with it (a group) leave together."""
        seq = self._pick(self.live, i)
        family = [s for s in self.live if s is seq or set(s.block_table) & set(seq.block_table)]
        if self.bm.can_swap_out(family):
            self.kv.copy(self.bm.swap_out(family), self.kv.device, self.kv.host)
            self.live = [s for s in self.live if s not in family]
            self.swapped.append(family)

    @precondition(lambda self: self.swapped)
    @rule(i=st.integers(0, 99))
    def swap_in(self, i: int) -> None:
        family = self._pick(self.swapped, i)
        if not self.bm.can_swap_in(family, reserve=0):
            return
        self.kv.copy(self.bm.swap_in(family), self.kv.host, self.kv.device)
        self.swapped.remove(family)
        self.live.extend(family)
        for seq in family:
            self.kv.check(seq, seq.num_computed_tokens)
        # can_swap_in promised room for every decoding sequence's next slot as well.
        decoders = [s for s in family if s.num_tokens - s.num_computed_tokens == 1]
        assert self.bm.blocks_to_append_all(decoders) <= self.bm.num_free_blocks()
        for seq in decoders:
            self.kv.copy(self.bm.append_slots(seq), self.kv.device, self.kv.device)

    @invariant()
    def pools_are_consistent(self) -> None:
        # free + used = total on both pools, no block owned twice, refcounts = table references.
        self.bm.check_invariants(self.live + [s for family in self.swapped for s in family])

    @invariant()
    def only_written_blocks_are_findable(self) -> None:
        for block_hash, block in self.bm.findable_blocks().items():
            tokens = self.bm.registered_tokens(block)
            slots = self.kv.device.get(block)
            assert slots is not None and all(s is not None for s in slots), f"block {block} findable unwritten"
            assert [s[-1] for s in slots] == tokens, f"block {block} holds other tokens than its hash says"
            prefix = list(slots[0][:-1])
            parent = ROOT_HASH
            for j in range(0, len(prefix), BS):
                parent = hash_block(parent, prefix[j:j + BS])
            assert hash_block(parent, tokens) == block_hash

    @invariant()
    def live_sequences_read_their_own_kv(self) -> None:
        for seq in self.live:
            self.kv.check(seq, seq.num_computed_tokens)

    def teardown(self) -> None:
        for seq in self.live + [s for family in self.swapped for s in family]:
            self.bm.free(seq)
        self.bm.check_invariants([])
        assert self.bm.num_free_blocks() == 16 and self.bm.num_free_swap_blocks() == 10


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
