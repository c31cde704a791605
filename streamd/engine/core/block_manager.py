"""BlockManager: the paper's KV cache manager (§4.2-§4.5). Plain Python, no torch.

It owns the physical blocks of both pools, their reference counts and free lists, every sequence's page
table (`Sequence.block_table`, device block ids, read by the ModelRunner; written only here) and, for swapped sequences,
their host page tables. It decides where KV lives; the CacheEngine moves the bytes, following the
(src, dst) pairs returned here.

Device pool: a block is either held (refcount > 0), free and unregistered, or free and still findable
by its prefix-cache hash. Free findable blocks count as free and are reused least recently freed first,
after the unregistered ones, so cached prefixes survive as long as memory allows.

A sequence's table always covers the token slots it is about to write: the whole token list after
`allocate`, `num_computed_tokens + n` after `append_slots(seq, n)`.

Below the device's prefix cache sit optional lower tiers (`host_tier.py` in the swap pool's free blocks,
then `disk_tier.py`): a findable block the device LRU reuses is spilled down, admission's chain continues
in them, and the moves leave as one step's `TierOrders` (`take_tier_orders`) for the CacheEngine.
A host hit admitted beside other work is restored *ahead* (`allocate(..., ahead=True)`): its copy overlaps
this step's forward, so no sequence holding one of its blocks may compute in this step (`restoring_ahead`,
which the scheduler asks); the next step's forward waits for the copy.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seqs
from contextlib import contextmanager
from typing import Protocol

from streamd.engine.core.host_tier import HostCache
from streamd.engine.core.kv_tiers import BlockKey, CachedBlock, KVTier, TierOrders
from streamd.engine.core.prefix_cache import PrefixCache, SeqHashes
from streamd.engine.stats import KVCacheStats

CopyPairs = tuple[tuple[int, int], ...]
_NO_COPIES: CopyPairs = ()
# A table entry a sequence no longer holds: a sliding-window layer's block that fell behind its window
# (`release_behind`; only the hybrid layout's window group has them, `hybrid_blocks.py`).
HOLE = -1


class PagedSeq(Protocol):
    """What the block manager reads of a sequence: a `Sequence`, or the window group's view of one
    (`hybrid_blocks.WindowSide`, whose `block_table` is the sequence's `window_table`)."""

    block_table: list[int]

    @property
    def seq_id(self) -> int: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def prefix_root(self) -> int: ...


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_swap_blocks: int = 0,
        watermark: float = 0.01,
        enable_prefix_caching: bool = True,
        tier: KVTier | None = None,
        host_cache: HostCache | None = None,
    ) -> None:
        """`tier`: the prefix cache's lowest tier (disk), which takes evicted cached blocks and gives them back
        (`kv_tiers.py`); `host_cache`: the host-RAM tier above it, in the swap pool's free blocks."""
        if num_blocks <= 0 or block_size <= 0 or num_swap_blocks < 0:
            raise ValueError("num_blocks and block_size must be > 0 and num_swap_blocks >= 0")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_swap_blocks = num_swap_blocks
        self.watermark = watermark
        # `free - needed >= watermark * num_blocks` in whole blocks (the epsilon absorbs float noise).
        self.watermark_blocks = math.ceil(watermark * num_blocks - 1e-9)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_bytes = 0  # one block's bytes, for the stats (the builder sets it)
        self._ref = [0] * num_blocks
        # Stack: the lowest ids come out first, which keeps tests and copy runs readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._cache = PrefixCache(num_blocks)
        self._seq_hashes: dict[int, SeqHashes] = {}
        # Full blocks this step's forward writes (hash -> block, parent hash, token ids). Each layer stores
        # the whole batch's K/V before attending, so a sequence admitted in the same step may read them:
        # two requests that arrive together share their common prefix instead of computing it twice.
        self._in_step: dict[int, tuple[int, int, list[int]]] = {}
        self._host_ref = [0] * num_swap_blocks
        self._host_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self._host_tables: dict[int, list[int]] = {}
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.allocated_blocks = 0  # cumulative: blocks taken off the free lists for new content
        self.copied_blocks = 0  # cumulative: copy-on-write copies ordered
        self.prefix_cache_queried_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.device_hit_blocks = 0  # cumulative
        self.tier = tier if enable_prefix_caching else None
        self.host_cache = host_cache if enable_prefix_caching and num_swap_blocks else None
        self._tier_orders: TierOrders | None = None  # this step's tier moves, made at its first one
        # With a host tier: host hits being copied in this step (not evictable), and host blocks freed in this
        # step (not reusable before its copies ran: a swap-in may still read them).
        self._host_pinned: list[int] = []
        self._host_freed: list[int] = []
        # Device blocks a host restore ordered ahead fills while this step's forward runs (until its orders
        # are taken): whoever holds one computes from the next step on.
        self._arriving: set[int] = set()

    # ---- capacity -------------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._cached_free)

    def num_free_swap_blocks(self) -> int:
        """Host blocks a swap-out may take now: free ones and those holding only a cached prefix."""
        return len(self._host_free) + (self.host_cache.evictable() if self.host_cache is not None else 0)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) <= self.num_blocks - self.watermark_blocks

    def worst_case_blocks(self, num_prompt_tokens: int, max_output_tokens: int, width: int) -> int:
        """Blocks a request of `width` sequences forked after its prompt holds at most: the prompt's full
        blocks once (shared), and each sequence's own blocks from the prompt's last partly filled one on."""
        shared = num_prompt_tokens // self.block_size
        return shared + width * (self.blocks_needed(num_prompt_tokens + max_output_tokens) - shared)

    # ---- admission ------------------------------------------------------------------------------

    def blocks_to_allocate(self, seqs: Iterable[PagedSeq], reuse_prefix: bool = True) -> int:
        """Free blocks that allocating `seqs` would consume: prefix hits on held blocks cost nothing,
        hits on free cached blocks take them off the free list. Counts a hit shared by two of `seqs`
        twice, which only errs on the safe side. `reuse_prefix` False: no hits (see `allocate`)."""
        return sum(self.allocation_cost(seq, self.prefix_hits(seq, reuse_prefix)) for seq in seqs)

    def allocation_cost(self, seq: PagedSeq, hits: list[int]) -> int:
        """Free blocks `allocate` takes for `seq` when these device `hits` start its table."""
        return self.blocks_needed(seq.num_tokens) - len(hits) + sum(1 for b in hits if self._ref[b] == 0)

    def can_allocate(self, seqs: Iterable[PagedSeq], reserve: int | None = None, reuse_prefix: bool = True) -> bool:
        """Watermark admission: `free - needed >= reserve` (default: the watermark)."""
        reserve = self.watermark_blocks if reserve is None else reserve
        return self.num_free_blocks() - self.blocks_to_allocate(seqs, reuse_prefix) >= reserve

    def allocate(
        self, seq: PagedSeq, reuse_prefix: bool = True, ahead: bool = False, hits: list[int] | None = None
    ) -> int:
        """Gives `seq` blocks for all its tokens, reusing cached prefix blocks. Returns the cached token
        count, which never includes the last token: the caller (the scheduler) makes it the sequence's
        `num_computed_tokens`. `reuse_prefix` False (a request with prompt logprobs, which needs the logits
        of every prompt position): no hits, every token is computed; its blocks are still registered for
        later requests to find. `ahead` (the step has other work): host hits are copied in beside the step's
        forward (`TierOrders.host_restores_ahead`), and `restoring_ahead(seq)` says so. `hits`: the device hits
        to use, a prefix of `prefix_hits(seq)` the caller found (the hybrid layout cuts them back); by default
        all of them."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        if hits is None:
            hits = self.prefix_hits(seq, reuse_prefix)
        if self.allocation_cost(seq, hits) > self.num_free_blocks():
            raise RuntimeError("not enough free KV cache blocks; check can_allocate first")
        fresh = self.blocks_needed(seq.num_tokens) - len(hits)
        for block in hits:  # take hits before allocating so eviction cannot pick them
            self._take(block)
        num_hits = len(hits)
        # Lower-tier hits are found (host ones pinned) before allocating, whose evictions could push them out.
        found = self._find_in_tiers(seq, num_hits, fresh) if reuse_prefix else []
        seq.block_table = hits + [self._alloc() for _ in range(fresh)]
        if self.enable_prefix_caching:
            state = self._hashes(seq)
            state.num_committed = num_hits
            self.device_hit_blocks += num_hits
            if found:
                self._order_restores(seq, num_hits, found, ahead)
                # Restored blocks are findable at once: the restore precedes every forward that reads them (one
                # ahead holds back, through `restoring_ahead`, whoever shares them in this step).
                num_hits += len(found)
                self._cache.commit(state, seq.token_ids, seq.block_table, num_hits)
            self.prefix_cache_queried_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += num_hits * self.block_size
        return num_hits * self.block_size

    # ---- growth ---------------------------------------------------------------------------------

    def blocks_to_append(self, seq: PagedSeq, num_new_tokens: int = 1) -> int:
        """Free blocks `append_slots(seq, num_new_tokens)` may consume (new blocks and copies)."""
        table, ref, bs = seq.block_table, self._ref, self.block_size
        first = seq.num_computed_tokens // bs
        last = (seq.num_computed_tokens + num_new_tokens - 1) // bs
        if first == last:  # the decode fast path
            if first >= len(table):
                return 1
            return 1 if ref[table[first]] > 1 else 0
        need = max(0, last + 1 - len(table))
        return need + sum(1 for i in range(first, min(last + 1, len(table))) if ref[table[i]] > 1)

    def blocks_to_append_all(self, seqs: Seqs[PagedSeq], num_new_tokens: int = 1) -> int:
        """Like `blocks_to_append` summed over `seqs`, but exact when they share the blocks they write:
        w writers of a block with refcount r copy it min(w, r - 1) times (the last writer keeps it)."""
        if len(seqs) == 1:
            return self.blocks_to_append(seqs[0], num_new_tokens)
        bs, new_blocks = self.block_size, 0
        writers: dict[int, int] = {}
        for seq in seqs:
            table = seq.block_table
            first = seq.num_computed_tokens // bs
            last = (seq.num_computed_tokens + num_new_tokens - 1) // bs
            new_blocks += max(0, last + 1 - len(table))
            for i in range(first, min(last + 1, len(table))):
                writers[table[i]] = writers.get(table[i], 0) + 1
        return new_blocks + sum(min(w, self._ref[b] - 1) for b, w in writers.items())

    # A table covers a whole prompt from `allocate` on, so a running prompt's chunk needs nothing more (the
    # hybrid layout's window group covers one chunk ahead: `HybridBlockManager`'s versions do the work).
    def try_cover_prompt(self, seq: PagedSeq) -> CopyPairs | None:
        return _NO_COPIES

    def can_cover_prompts(self, seqs: Seqs[PagedSeq]) -> bool:
        return True

    def cover_prompts(self, seqs: Seqs[PagedSeq]) -> CopyPairs:
        return _NO_COPIES

    def can_append(self, seq: PagedSeq, num_new_tokens: int) -> bool:
        """Whether `append_slots(seq, num_new_tokens)` leaves the watermark free (a draft's slots)."""
        return self.blocks_to_append(seq, num_new_tokens) <= self.num_free_blocks() - self.watermark_blocks

    def can_append_all(self, seqs: Seqs[PagedSeq]) -> bool:
        """Whether every one of `seqs` can take its next slot now."""
        return self.blocks_to_append_all(seqs) <= self.num_free_blocks()

    def free_state(self) -> int:
        """Changes whenever the free blocks do (the scheduler's blocked-head check compares it)."""
        return self.num_free_blocks()

    @property
    def follows_progress(self) -> bool:
        """Whether `mark_computed` must hear of every block a sequence's computed tokens complete."""
        return self.enable_prefix_caching

    def try_append_slots(self, seq: PagedSeq, num_new_tokens: int = 1) -> CopyPairs | None:
        """`append_slots` if the free blocks suffice, else None (and nothing changes)."""
        start = seq.num_computed_tokens
        index, table = start // self.block_size, seq.block_table
        if (start + num_new_tokens - 1) // self.block_size == index < len(table) and self._ref[table[index]] == 1:
            return _NO_COPIES  # the decode fast path: room in an unshared last block
        if self.blocks_to_append(seq, num_new_tokens) > self.num_free_blocks():
            return None
        return self.append_slots(seq, num_new_tokens)

    def append_slots(self, seq: PagedSeq, num_new_tokens: int = 1) -> CopyPairs:
        """Makes the table cover `num_computed_tokens + num_new_tokens` slots. A shared block about to
        be written is replaced by a private one (copy-on-write); returns the (src, dst) copies."""
        table, ref, bs = seq.block_table, self._ref, self.block_size
        start = seq.num_computed_tokens
        first, last = start // bs, (start + num_new_tokens - 1) // bs
        if first == last and first < len(table) and ref[table[first]] == 1:
            return _NO_COPIES
        copies = _NO_COPIES
        for i in range(first, min(last + 1, len(table))):
            shared = table[i]
            if ref[shared] > 1:
                ref[shared] -= 1
                table[i] = self._alloc()
                # Only the first written block holds KV this sequence still needs (slots before `start`).
                if i == first and start % bs:
                    copies += ((shared, table[i]),)
                    self.copied_blocks += 1
        while len(table) <= last:
            table.append(self._alloc())
        return copies

    def truncate(self, seq: PagedSeq, num_tokens: int) -> None:
        """Gives back the blocks of `seq`'s table past its first `num_tokens` slots (the slots rejected draft
        tokens took: their KV was never registered, so nothing findable goes)."""
        table, keep = seq.block_table, self.blocks_needed(num_tokens)
        while len(table) > keep:
            block = table.pop()
            if block != HOLE:
                self._release(block)

    # ---- a sliding window's blocks (the hybrid layout's window group, `hybrid_blocks.py`) -------

    def cached_block(self, seq: PagedSeq, index: int) -> int | None:
        """The device block the prefix cache holds for `seq`'s full block `index` (held or free), if any."""
        if not self.enable_prefix_caching:
            return None
        return self._cache.find(self._hashes(seq), seq.token_ids, index)

    def allocate_window(self, seq: PagedSeq, first: int, hits: list[int], upto_tokens: int) -> None:
        """A table that holds nothing before block `first` (holes), then the cached `hits` (taken), then fresh
        blocks up to slot `upto_tokens`: a sliding window's blocks for a sequence whose first
        `first + len(hits)` blocks are cached and whose next `upto_tokens` slots are about to be written."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already has blocks")
        if self.window_cost(first, hits, upto_tokens) > self.num_free_blocks():
            raise RuntimeError("not enough free KV cache blocks; check the window cost first")
        for block in hits:
            self._take(block)
        fresh = self.blocks_needed(upto_tokens) - first - len(hits)
        seq.block_table = [HOLE] * first + hits + [self._alloc() for _ in range(fresh)]
        if self.enable_prefix_caching:
            self._hashes(seq).num_committed = first + len(hits)

    def window_cost(self, first: int, hits: list[int], upto_tokens: int) -> int:
        """Free blocks `allocate_window(seq, first, hits, upto_tokens)` takes."""
        fresh = self.blocks_needed(upto_tokens) - first - len(hits)
        return fresh + sum(1 for b in hits if self._ref[b] == 0)

    def release_behind(self, seq: PagedSeq, first_needed: int) -> None:
        """Gives back `seq`'s blocks before block `first_needed` (they fell behind its window); registered ones
        stay findable until reused, for the prefix hits of later requests."""
        table = seq.block_table
        index = min(first_needed, len(table)) - 1
        while index >= 0 and table[index] != HOLE:
            self._release(table[index])
            table[index] = HOLE
            index -= 1

    def _hashes(self, seq: PagedSeq) -> SeqHashes:
        state = self._seq_hashes.get(seq.seq_id)
        if state is None:
            state = self._seq_hashes[seq.seq_id] = SeqHashes(self.block_size, root=seq.prefix_root)
        return state

    def fork(self, parent: PagedSeq, child: PagedSeq) -> None:
        """`child` shares every block of `parent` (both pools); it must not own blocks yet. Only a
        sequence past its prompt forks: shared blocks are then written only through `append_slots`."""
        if parent.num_tokens - parent.num_computed_tokens > 1:
            raise ValueError(f"sequence {parent.seq_id} is still prefilling; fork it after its prompt")
        child.block_table = list(parent.block_table)
        for block in _held(child.block_table):
            self._ref[block] += 1
        host = self._host_tables.get(parent.seq_id)
        if host is not None:
            self._host_tables[child.seq_id] = list(host)
            for block in _held(host):
                self._host_ref[block] += 1
        state = self._seq_hashes.get(parent.seq_id)
        if state is not None:
            self._seq_hashes[child.seq_id] = state.copy()

    def free(self, seq: PagedSeq) -> None:
        """Releases everything `seq` holds in both pools. Idempotent."""
        table = seq.block_table
        if table:
            # Tail first: the LRU then evicts a freed sequence's last blocks before its prefix,
            # which is the part other requests are likely to share.
            for block in _held(reversed(table)):
                self._release(block)
            seq.block_table = []
        host = self._host_tables.pop(seq.seq_id, None)
        if host is not None:
            for block in _held(host):
                self._release_host(block)
        self._seq_hashes.pop(seq.seq_id, None)

    # ---- prefix caching -------------------------------------------------------------------------

    def mark_computed(self, seq: PagedSeq) -> None:
        """Registers the hashes of `seq`'s full blocks whose KV is now written (call after the
        forward that wrote them, with `num_computed_tokens` updated)."""
        state = self._seq_hashes.get(seq.seq_id)
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if state is not None and num_full > state.num_committed:
            self._cache.commit(state, seq.token_ids, seq.block_table, num_full)

    def prefix_hits(self, seq: PagedSeq, reuse_prefix: bool = True) -> list[int]:
        """Device blocks holding the longest cached prefix of `seq`, leaving at least its last token
        to compute (the forward must produce its logits); none when not `reuse_prefix`."""
        if not self.enable_prefix_caching:
            return []
        state = self._hashes(seq)
        if not reuse_prefix:
            return []
        limit = (seq.num_tokens - 1) // self.block_size
        hits = self._cache.match(state, seq.token_ids, limit)
        bs = self.block_size
        for index in range(len(hits), limit if self._in_step else 0):
            entry = self._in_step.get(state.block_hash(seq.token_ids, index))
            if (
                entry is None
                or entry[1] != state.parent(index)
                or entry[2] != seq.token_ids[index * bs : (index + 1) * bs]
            ):
                break
            hits.append(entry[0])
        return hits

    def end_step(self) -> None:
        """Forgets this step's in-step blocks once its plan is made: later steps find them through the
        prefix cache, after their writer commits them."""
        if self._in_step:
            self._in_step.clear()

    def publish_in_step(self, seq: PagedSeq, upto: int) -> None:
        """`seq`'s full blocks below token `upto` are written by this step's forward: sequences admitted
        later in this step may share them."""
        if not self.enable_prefix_caching:
            return
        state, bs = self._seq_hashes[seq.seq_id], self.block_size
        for index in range(state.num_committed, min(upto // bs, len(seq.block_table))):
            block_hash = state.block_hash(seq.token_ids, index)
            self._in_step.setdefault(
                block_hash, (seq.block_table[index], state.parent(index), seq.token_ids[index * bs : (index + 1) * bs])
            )

    def reading_ahead(self, seqs: Iterable[PagedSeq]) -> bool:
        """Whether admitting `seqs` now would read disk blocks of their prefix chains that the disk tier's
        reader is reading ahead (handed to it here if not yet): the scheduler then lets them wait a step
        rather than read inside a step that other sequences run in."""
        if self.tier is None:
            return False
        busy = False
        for seq in seqs:
            first = len(self.prefix_hits(seq))
            keys = [key for key in self._tier_chain(seq, first) if not self._on_host(key)]
            busy |= bool(keys) and self.tier.read_ahead(keys)
        return busy

    def _on_host(self, key: BlockKey) -> bool:
        return self.host_cache is not None and self.host_cache.contains(key)

    def _tier_chain(self, seq: PagedSeq, first: int) -> Iterator[BlockKey]:
        """The keys of `seq`'s full blocks from `first` on (its last token excluded), in order."""
        state, bs = self._seq_hashes.get(seq.seq_id), self.block_size
        if state is None:
            return
        for index in range(first, (seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[index * bs : (index + 1) * bs]
            key = BlockKey(state.block_hash(seq.token_ids, index), state.parent(index), tuple(tokens))
            if not (self._on_host(key) or (self.tier is not None and self.tier.contains(key))):
                return
            yield key

    def _find_in_tiers(self, seq: PagedSeq, first: int, fresh: int) -> list[int | bytes]:
        """Continues `seq`'s prefix chain in the lower tiers from block `first`, block by block: a host
        block (pinned for this step) or the disk tier's verified bytes (read ahead, or read now); stops at
        the first miss. Each tier only while reading from it beats recomputing."""
        host = self.host_cache if self.host_cache is not None and self.host_cache.worth_reading() else None
        disk = self.tier if self.tier is not None and self.tier.worth_reading() else None
        found: list[int | bytes] = []
        if host is None and disk is None:
            return found
        for key in itertools.islice(self._tier_chain(seq, first), fresh):
            if host is not None and (cached := host.lookup(key)) is not None:
                host.pin(cached)
                self._host_pinned.append(cached)
                found.append(cached)
                continue
            payload = disk.fetch(key) if disk is not None else None
            if payload is None:
                break
            found.append(payload)
        return found

    def _order_restores(self, seq: PagedSeq, first: int, found: list[int | bytes], ahead: bool) -> None:
        """Orders what `_find_in_tiers` found copied into the sequence's fresh blocks from `first` on; host
        blocks `ahead` (overlapping the step's forward) when asked."""
        orders = self._orders()
        from_host = orders.host_restores_ahead if ahead else orders.host_restores
        for block, source in zip(seq.block_table[first:], found, strict=False):
            if isinstance(source, bytes):
                orders.restores.append((block, source))
                continue
            from_host.append((source, block))
            if ahead:
                self._arriving.add(block)

    def restoring_ahead(self, seq: PagedSeq) -> bool:
        """Whether `seq` holds a block that a host restore ordered ahead in this step fills (its own restore,
        or a prefix hit on another's): it must not compute before the next step, whose forward waits for the
        copy."""
        arriving = self._arriving
        return bool(arriving) and not arriving.isdisjoint(seq.block_table)

    def _spill(self, block: int, to_host: bool = True) -> None:
        """A findable device block is about to be reused: its content goes to the host tier if there is
        one (and a host block for it), else to the disk tier."""
        block_key = self._cache.key_of(block)
        if block_key is None:
            return
        host = self.host_cache if to_host else None
        if host is not None:
            if host.contains(block_key):
                return
            dst = self._alloc_host()
            if dst is not None:
                host.add(dst, block_key)
                host.pin(dst, hit=False)
                self._host_pinned.append(dst)
                self._orders().host_spills.append((block, dst))
                return
        if self.tier is not None and not self.tier.contains(block_key):  # (restored blocks are there already)
            self._orders().spills.append((block, block_key))

    @contextmanager
    def tiers_off(self) -> Iterator[None]:
        """Within it the lower tiers are neither read nor written: for throw-away work (the engine's warm-up),
        which is not traffic. (A restarted CUDA engine's warm-up read the previous engine's warm-up blocks back
        from disk, and those reads set the disk tier's read estimate that decides whether the first real
        request reads at all: on the H200 they shut the tier before it.) Entered between steps, with no tier
        order outstanding."""
        tier, host = self.tier, self.host_cache
        self.tier = self.host_cache = None
        try:
            yield
        finally:
            self.tier, self.host_cache = tier, host

    def persist_order(self) -> list[CachedBlock]:
        """Every cached block, each content once, most valuable first (at shutdown, for the disk tier): the
        device's blocks in use, then its free cached ones, then the host tier's, each most recently used
        first. A sequence's prefix comes before its later blocks (tables are freed tail first, and the device
        evicts to the host tier in that order), so a cut anywhere down the list mostly keeps whole chains."""
        if self.tier is None:
            return []
        held = [b for b in self._cache.registered().values() if self._ref[b] > 0]
        device = [*held, *reversed(self._cached_free)]
        cached = [CachedBlock(key, b) for b in device if (key := self._cache.key_of(b)) is not None]
        host = self.host_cache
        on_host = [CachedBlock(host.key_of(b), b, True) for b in reversed(host.cached_blocks())] if host else []
        return _each_content_once(cached + on_host)

    def take_tier_orders(self) -> TierOrders | None:
        """This step's spills and restores (the scheduler hands them to the CacheEngine with the plan); None
        when it ordered none (most steps, and every step without a tier: nothing is made or carried)."""
        orders, self._tier_orders = self._tier_orders, None
        self._arriving.clear()
        if self.host_cache is not None:
            for block in self._host_pinned:
                self.host_cache.unpin(block)
            self._host_pinned.clear()
            self._host_free.extend(self._host_freed)
            self._host_freed.clear()
        return orders

    def _orders(self) -> TierOrders:
        """This step's tier orders, made at its first move."""
        if self._tier_orders is None:
            self._tier_orders = TierOrders.none()
        return self._tier_orders

    def _cached_copy(self, seq: PagedSeq, index: int) -> int | None:
        """A device block already holding `seq`'s committed block `index`, if the cache has one."""
        state = self._seq_hashes.get(seq.seq_id)
        if state is None or index >= state.num_committed:
            return None
        return self._cache.find(state, seq.token_ids, index)

    # ---- swapping -------------------------------------------------------------------------------

    def unique_blocks(self, seqs: Iterable[PagedSeq]) -> int:
        return len({b for seq in seqs for b in _held(seq.block_table)})

    def can_swap_out(self, seqs: Iterable[PagedSeq]) -> bool:
        return self.unique_blocks(seqs) <= self.num_free_swap_blocks()

    def swap_out(self, seqs: Seqs[PagedSeq]) -> list[tuple[int, int]]:
        """Moves all of `seqs`' device blocks to the host pool (sharing preserved); returns the
        (device, host) copies. The device blocks are released, findable ones stay cached."""
        if not self.can_swap_out(seqs):
            raise RuntimeError("not enough free swap blocks; check can_swap_out first")
        mapping: dict[int, int] = {}
        for seq in seqs:
            host_table = []
            for block in seq.block_table:
                if block == HOLE:
                    host_table.append(HOLE)
                    continue
                host = mapping.get(block)
                if host is None:
                    host = mapping[block] = self._take_host()
                self._host_ref[host] += 1
                host_table.append(host)
            self._host_tables[seq.seq_id] = host_table
            for block in _held(reversed(seq.block_table)):
                self._release(block)
            seq.block_table = []
        self.swapped_out_blocks += len(mapping)
        return list(mapping.items())

    def blocks_to_swap_in(self, seqs: Iterable[PagedSeq]) -> int:
        """Device blocks that swapping `seqs` in and then giving each decoding one its next slot takes
        (a new block, or a copy of a last block it shares with others of `seqs`)."""
        refs: dict[int, int] = {}  # host block -> references from `seqs`
        writers: dict[int, int] = {}
        growth = 0
        for seq in seqs:
            table = self._host_tables[seq.seq_id]
            for host in _held(table):
                refs[host] = refs.get(host, 0) + 1
            if seq.num_tokens - seq.num_computed_tokens == 1:
                index = seq.num_computed_tokens // self.block_size
                if index >= len(table):
                    growth += 1
                else:
                    writers[table[index]] = writers.get(table[index], 0) + 1
        return len(refs) + growth + sum(min(w, refs[h] - 1) for h, w in writers.items())

    def can_swap_in(self, seqs: Iterable[PagedSeq], reserve: int | None = None) -> bool:
        reserve = self.watermark_blocks if reserve is None else reserve
        return self.num_free_blocks() - self.blocks_to_swap_in(seqs) >= reserve

    def swap_in(self, seqs: Seqs[PagedSeq]) -> list[tuple[int, int]]:
        """Brings `seqs` back to the device; returns the (host, device) copies. A block whose content
        is still cached on the device is reused instead of copied."""
        mapping: dict[int, int] = {}
        copies: list[tuple[int, int]] = []
        for seq in seqs:
            table = []
            for i, host in enumerate(self._host_tables.pop(seq.seq_id)):
                if host == HOLE:
                    table.append(HOLE)
                    continue
                block = mapping.get(host)
                if block is not None:
                    self._ref[block] += 1
                else:
                    block = self._cached_copy(seq, i)
                    if block is not None:
                        self._take(block)
                    else:
                        block = self._alloc()
                        copies.append((host, block))
                    mapping[host] = block
                table.append(block)
                self._release_host(host)
            seq.block_table = table
        self.swapped_in_blocks += len(copies)
        return copies

    # ---- pool primitives ------------------------------------------------------------------------

    def _alloc(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._cached_free:
            block, _ = self._cached_free.popitem(last=False)  # least recently freed
            if self.tier is not None or self.host_cache is not None:  # (no tier: no key to build)
                self._spill(block)
            self._cache.forget(block)
        else:
            raise RuntimeError("out of KV cache blocks")
        self._ref[block] = 1
        self.allocated_blocks += 1
        return block

    def _take(self, block: int) -> None:
        """One more reference to a block found in the cache (reviving it if it was free)."""
        if self._ref[block] == 0:
            del self._cached_free[block]
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if self._cache.is_registered(block):
                self._cached_free[block] = None
            else:
                self._free.append(block)

    def _release_host(self, block: int) -> None:
        self._host_ref[block] -= 1
        if self._host_ref[block] == 0:
            (self._host_freed if self.host_cache is not None else self._host_free).append(block)

    def _take_host(self) -> int:
        block = self._alloc_host()
        if block is None:
            raise RuntimeError("out of host blocks; check can_swap_out first")
        return block

    def _alloc_host(self) -> int | None:
        """A free host block, else the least recently used cached one (its content goes on to the disk tier)."""
        if self._host_free:
            return self._host_free.pop()
        evicted = self.host_cache.evict() if self.host_cache is not None else None
        if evicted is None:
            return None
        block, key = evicted
        if self.tier is not None and not self.tier.contains(key):
            self._orders().host_to_disk.append((block, key))
        return block

    # ---- observability --------------------------------------------------------------------------

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def findable_blocks(self) -> dict[int, int]:
        """hash -> device block of every block the prefix cache can hand out."""
        return self._cache.registered()

    def registered_tokens(self, block: int) -> list[int] | None:
        return self._cache.tokens_of(block)

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            blocks_total=self.num_blocks,
            blocks_free=self.num_free_blocks(),
            blocks_cached=len(self._cached_free),
            swap_blocks_total=self.num_swap_blocks,
            swap_blocks_free=self.num_free_swap_blocks() + len(self._host_freed),
            swapped_out_blocks=self.swapped_out_blocks,
            swapped_in_blocks=self.swapped_in_blocks,
            prefix_queried_tokens=self.prefix_cache_queried_tokens,
            prefix_hit_tokens=self.prefix_cache_hit_tokens,
            allocated_blocks=self.allocated_blocks,
            copied_blocks=self.copied_blocks,
            device_hit_blocks=self.device_hit_blocks,
            block_bytes=self.block_bytes,
            tiers=[t.stats() for t in (self.host_cache, self.tier) if t is not None],
        )

    def check_invariants(self, seqs: Iterable[PagedSeq]) -> None:
        """Raises AssertionError unless the pools are consistent with `seqs` (every sequence that may
        hold blocks). With no live sequences this is the leak check: every block is free."""
        seqs = list(seqs)
        _check_pool("device", self._ref, self._free + list(self._cached_free), [s.block_table for s in seqs])
        known = {s.seq_id for s in seqs}
        assert set(self._host_tables) <= known, "host blocks held for a sequence that is gone"
        assert set(self._seq_hashes) <= known, "prefix-cache state kept for a sequence that is gone"
        assert not self._in_step, "blocks shared within a step outlived the step's planning"
        cached_host = self.host_cache.cached_blocks() if self.host_cache is not None else []
        assert not self._host_pinned, "host hits pinned past their step's orders"
        assert not self._arriving, "blocks restored ahead still marked arriving past their step's orders"
        host_free = self._host_free + self._host_freed + cached_host
        _check_pool("host", self._host_ref, host_free, list(self._host_tables.values()))
        for block in self._free:
            assert not self._cache.is_registered(block), f"unregistered free list holds findable block {block}"
        for block_hash, block in self._cache.registered().items():
            assert self._cache.is_registered(block), f"hash {block_hash} maps to unregistered block {block}"


def _held(table: Iterable[int]) -> Iterator[int]:
    """The blocks of a table, without its holes."""
    return (block for block in table if block != HOLE)


def _each_content_once(blocks: list[CachedBlock]) -> list[CachedBlock]:
    """`blocks` without later copies of a content (a host hit copied back to the device stays cached there)."""
    first: dict[int, CachedBlock] = {}
    for block in blocks:
        first.setdefault(block.key.block_hash, block)
    return list(first.values())


def _check_pool(name: str, refs: list[int], free: list[int], tables: list[list[int]]) -> None:
    counts = [0] * len(refs)
    for table in tables:
        for block in _held(table):
            counts[block] += 1
    assert counts == refs, f"{name}: reference counts differ from the page tables"
    assert len(set(free)) == len(free), f"{name}: a block is on the free list twice"
    held = [b for b, r in enumerate(refs) if r > 0]
    assert not set(free) & set(held), f"{name}: a held block is also free"
    assert len(free) + len(held) == len(refs), f"{name}: free + used != total (leaked blocks)"
