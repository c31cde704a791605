"""HybridBlockManager (the hybrid KV layout): unit tests and a hypothesis state machine over a shadow KV of both
pools.

The shadow stores, in every slot a sequence writes, the token prefix that produced it, in the full pool and in
the window pool (one id space: window blocks numbered after the full ones, as the executor sees them).
Whatever the manager does (window releases, prefix hits cut back to what the window group holds,
copy-on-write, swap, eviction), a sequence must read its own KV through `block_table` at every computed
position and through `window_table` at every position its next query's window covers, while holding no window
block before that window.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from streamd.engine.core.block_manager import HOLE, BlockManager
from streamd.engine.core.hybrid_blocks import HybridBlockManager
from streamd.engine.core.sequence import Sequence

BS = 4
WINDOW = 6  # not a multiple of the block size: a window's edge falls inside a block
CHUNK = 8
FULL_BLOCKS, WINDOW_BLOCKS = 16, 12
FULL_SWAP, WINDOW_SWAP = 10, 8


def manager(full: int = FULL_BLOCKS, window: int = WINDOW_BLOCKS, caching: bool = True) -> HybridBlockManager:
    return HybridBlockManager(
        BlockManager(full, BS, FULL_SWAP, watermark=0.0, enable_prefix_caching=caching),
        BlockManager(window, BS, WINDOW_SWAP, watermark=0.0, enable_prefix_caching=caching),
        WINDOW,
        CHUNK,
    )


def first_visible(position: int) -> int:
    """The first position a query at `position` sees (itself and the W - 1 before it)."""
    return max(0, position - WINDOW + 1)


class ShadowKV:
    """What the two CacheEngines would hold, in the executor's one id space, moved by the manager's orders."""

    def __init__(self, bm: HybridBlockManager) -> None:
        self.bm = bm
        self.device: dict[int, list[tuple[int, ...] | None]] = {}
        self.host: dict[int, list[tuple[int, ...] | None]] = {}

    def write(self, seq: Sequence, start: int, stop: int) -> None:
        for pos in range(start, stop):
            window_block = seq.window_table[pos // BS]
            assert window_block != HOLE, f"seq {seq.seq_id} writes position {pos} into a hole"
            for block in (seq.block_table[pos // BS], window_block + self.bm.window_offset):
                self.device.setdefault(block, [None] * BS)[pos % BS] = tuple(seq.token_ids[: pos + 1])

    def check(self, seq: Sequence, stop: int) -> None:
        """The full layers read positions [0, stop), the sliding layers [first_visible(stop), stop)."""
        for pos in range(stop):
            self._check_slot(seq, pos, seq.block_table[pos // BS])
        for pos in range(first_visible(stop), stop):
            self._check_slot(seq, pos, seq.window_table[pos // BS] + self.bm.window_offset)

    def _check_slot(self, seq: Sequence, pos: int, block: int) -> None:
        slots = self.device.get(block)
        got = slots[pos % BS] if slots else None
        assert got == tuple(seq.token_ids[: pos + 1]), f"seq {seq.seq_id} reads wrong KV at {pos} (block {block})"

    def copy(self, pairs, src: dict, dst: dict) -> None:
        for a, b in pairs:
            dst[b] = list(src.get(a, [None] * BS))


def compute(bm: HybridBlockManager, kv: ShadowKV, seq: Sequence, n: int) -> None:
    """A forward over the next n uncomputed tokens (a prompt chunk already covered, or a decode)."""
    start = seq.num_computed_tokens
    stop = min(seq.num_tokens, start + n)
    kv.check(seq, start)
    kv.write(seq, start, stop)
    seq.num_computed_tokens = stop
    bm.mark_computed(seq)


def prefill(bm: HybridBlockManager, kv: ShadowKV, seq: Sequence) -> None:
    """The whole prompt, chunk by chunk, as the scheduler runs it: the first chunk in the step that admits it
    (`allocate` covered it), each later one once its window blocks are covered."""
    seq.num_computed_tokens = bm.allocate(seq)
    compute(bm, kv, seq, CHUNK)
    while seq.num_tokens - seq.num_computed_tokens > 0:
        kv.copy(bm.try_cover_prompt(seq) or (), kv.device, kv.device)
        compute(bm, kv, seq, CHUNK)


def held_window_blocks(seq: Sequence) -> int:
    return sum(block != HOLE for block in seq.window_table)


def test_a_long_request_holds_its_window_not_its_context() -> None:
    bm = manager()
    kv = ShadowKV(bm)
    seq = Sequence(list(range(1, 50)))  # 49 tokens: 13 blocks, far past the window pool's 12
    prefill(bm, kv, seq)
    assert len(seq.block_table) == 13
    # The window (6 positions) touches at most 3 blocks of 4; one more sits ahead for the next token.
    assert held_window_blocks(seq) <= 3
    assert seq.window_table[:9] == [HOLE] * 9
    for token in range(5):
        seq.append_token(100 + token)
        kv.copy(bm.try_append_slots(seq) or (), kv.device, kv.device)
        compute(bm, kv, seq, 1)
        assert held_window_blocks(seq) <= 3
    kv.check(seq, seq.num_computed_tokens)
    stats = bm.stats()
    assert stats.window_blocks_total - stats.window_blocks_free == held_window_blocks(seq)
    bm.free(seq)
    bm.check_invariants([])


def test_a_prefix_hit_past_the_window_needs_only_the_window_blocks() -> None:
    bm = manager()
    kv = ShadowKV(bm)
    first = Sequence(list(range(1, 30)))
    prefill(bm, kv, first)
    bm.free(first)  # both groups' blocks stay findable
    again = Sequence(list(range(1, 30)) + [99, 98])
    cached = bm.allocate(again)
    assert cached == 28, "the hit covers every full block of the shared prompt"
    # The window group took only the blocks the first query after the hit sees (positions 23-27: blocks 5, 6).
    assert again.window_table[:5] == [HOLE] * 5 and HOLE not in again.window_table[5:]
    again.num_computed_tokens = cached
    kv.check(again, cached)
    bm.free(again)
    bm.check_invariants([])


def test_a_hit_is_cut_back_to_where_the_window_group_still_holds_the_window() -> None:
    bm = manager()
    kv = ShadowKV(bm)
    first = Sequence(list(range(1, 30)))
    prefill(bm, kv, first)
    bm.free(first)
    # Another request takes every free window block: the cached window blocks of `first` are reused.
    filler = Sequence(list(range(200, 200 + 4 * WINDOW_BLOCKS)))
    filler.num_computed_tokens = bm.allocate(filler)
    while len(filler.window_table) < WINDOW_BLOCKS:
        bm.try_cover_prompt(filler)
        compute(bm, kv, filler, CHUNK)  # (its releases keep the blocks it covered findable, not free)
    bm.free(filler)
    again = Sequence(list(range(1, 30)) + [99])
    cached = bm.allocate(again)
    assert cached < 28, "a hit whose window blocks are gone is not used that far"
    again.num_computed_tokens = cached
    kv.check(again, cached)
    bm.free(again)
    bm.check_invariants([])


def test_admission_asks_both_pools() -> None:
    """Each prompt of 9 tokens takes 3 full blocks and 2 window blocks (one chunk of 8 ahead). With room for 20
    of the first and 8 of the second, four fit and a fifth is refused by the window pool alone; a long prompt
    that fits the window pool is refused by the full pool alone."""
    bm = manager(full=20, window=8)
    prompts = [Sequence([300 + i, 1, 2, 3, 4, 5, 6, 7, 8]) for i in range(5)]
    assert bm.can_allocate(prompts[:4], reserve=0)
    assert not bm.can_allocate(prompts, reserve=0), "five need 10 window blocks of 8 (15 full blocks of 20)"
    for seq in prompts[:4]:
        bm.allocate(seq)
    assert bm.full.num_free_blocks() == 8 and bm.window.num_free_blocks() == 0
    assert not bm.can_allocate([prompts[4]], reserve=0), "the window pool is full (the full pool is not)"
    bm.free(prompts[3])
    long = Sequence(list(range(1, 46)))  # 12 full blocks (11 free), 2 window blocks (2 free)
    assert not bm.can_allocate([long], reserve=0), "the full pool is short (the window pool is not)"
    assert bm.can_allocate([prompts[4]], reserve=0)
    for seq in [*prompts, long]:
        bm.free(seq)
    bm.check_invariants([])


def test_a_window_pool_too_small_for_one_prompt_is_refused_naming_the_settings() -> None:
    with pytest.raises(ValueError, match=r"swa_full_tokens_ratio.*max_num_batched_tokens"):
        manager(window=5)


def test_ids_of_window_orders_follow_the_full_pool() -> None:
    bm = manager()
    kv = ShadowKV(bm)
    parent = Sequence([1, 2, 3, 4, 5, 6])
    prefill(bm, kv, parent)
    parent.append_token(7)
    child = parent.fork()
    child.num_computed_tokens = parent.num_computed_tokens
    bm.fork(parent, child)
    copies = bm.try_append_slots(child)
    assert copies is not None
    assert any(src >= FULL_BLOCKS for src, _ in copies), "the shared window block was copied in the window pool"
    assert all((src >= FULL_BLOCKS) == (dst >= FULL_BLOCKS) for src, dst in copies)
    swapped = bm.swap_out([parent])
    assert any(device >= FULL_BLOCKS and host >= FULL_SWAP for device, host in swapped)
    assert all((device >= FULL_BLOCKS) == (host >= FULL_SWAP) for device, host in swapped)
    for seq in (parent, child):
        bm.free(seq)
    bm.check_invariants([])


PREFIXES = [list(range(1, 14)), [1, 2, 3, 4, 5, 6, 7, 8, 50, 60, 70, 80], [11, 12, 13, 14, 15, 16, 17, 18]]


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm = manager()
        self.kv = ShadowKV(self.bm)
        self.live: list[Sequence] = []
        self.swapped: list[list[Sequence]] = []

    def _pick(self, seqs: list, i: int):
        return seqs[i % len(seqs)]

    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(0, 13),
          suffix=st.lists(st.integers(0, 20), max_size=10), first_chunk=st.integers(0, CHUNK))
    def new_seq(self, prefix: int, cut: int, suffix: list[int], first_chunk: int) -> None:
        """Admission, and the first chunk of the prompt in the same step (0: it waits for the next)."""
        seq = Sequence(PREFIXES[prefix][:cut] + suffix or [0])
        if not self.bm.can_allocate([seq]):
            self.bm.free(seq)  # drops the hashes can_allocate computed
            return
        seq.num_computed_tokens = cached = self.bm.allocate(seq)
        assert cached % BS == 0 and cached < seq.num_tokens
        self.kv.check(seq, cached)  # a prefix hit hands over exactly this sequence's KV, in both pools
        self.live.append(seq)
        if first_chunk:
            compute(self.bm, self.kv, seq, first_chunk)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), n=st.integers(1, CHUNK))
    def prompt_chunk(self, i: int, n: int) -> None:
        seq = self._pick(self.live, i)
        if seq.num_tokens - seq.num_computed_tokens <= 1:
            return
        copies = self.bm.try_cover_prompt(seq)
        if copies is not None:
            self.kv.copy(copies, self.kv.device, self.kv.device)
            compute(self.bm, self.kv, seq, n)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), token=st.integers(0, 20))
    def sample(self, i: int, token: int) -> None:
        seq = self._pick(self.live, i)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_token(token)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def decode(self, i: int) -> None:
        seq = self._pick(self.live, i)
        if seq.num_tokens - seq.num_computed_tokens != 1:
            return
        copies = self.bm.try_append_slots(seq)
        if copies is not None:
            self.kv.copy(copies, self.kv.device, self.kv.device)
            compute(self.bm, self.kv, seq, 1)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def fork(self, i: int) -> None:
        parent = self._pick(self.live, i)
        if parent.num_tokens - parent.num_computed_tokens > 1:
            return
        child = parent.fork()
        child.num_computed_tokens = parent.num_computed_tokens
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i: int) -> None:
        self.bm.free(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def recompute(self, i: int) -> None:
        seq = self._pick(self.live, i)
        self.bm.free(seq)
        seq.num_computed_tokens = 0
        if self.bm.can_allocate([seq], reserve=0):
            seq.num_computed_tokens = self.bm.allocate(seq)
            self.kv.check(seq, seq.num_computed_tokens)
        else:
            self.bm.free(seq)
            self.live.remove(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def swap_out(self, i: int) -> None:
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
        prompts = [s for s in family if s.num_tokens - s.num_computed_tokens > 1]
        self.kv.copy(self.bm.cover_prompts(prompts), self.kv.device, self.kv.device)  # promised by can_swap_in
        self.swapped.remove(family)
        self.live.extend(family)
        for seq in family:
            self.kv.check(seq, seq.num_computed_tokens)

    @invariant()
    def pools_are_consistent(self) -> None:
        self.bm.check_invariants(self.live + [s for family in self.swapped for s in family])

    @invariant()
    def live_sequences_read_their_own_kv(self) -> None:
        for seq in self.live:
            self.kv.check(seq, seq.num_computed_tokens)

    @invariant()
    def no_window_block_is_held_behind_the_window(self) -> None:
        for seq in self.live:
            first = first_visible(seq.num_computed_tokens) // BS
            behind = [b for b in seq.window_table[: max(0, first - 1)] if b != HOLE]
            assert not behind, f"seq {seq.seq_id} holds window blocks {behind} behind its window"

    def teardown(self) -> None:
        for seq in self.live + [s for family in self.swapped for s in family]:
            self.bm.free(seq)
        self.bm.check_invariants([])
        assert self.bm.full.num_free_blocks() == FULL_BLOCKS
        assert self.bm.window.num_free_blocks() == WINDOW_BLOCKS
        assert self.bm.window.num_free_swap_blocks() == WINDOW_SWAP


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
