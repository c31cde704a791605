"""HybridBlockManager: the hybrid KV layout, in which a model's sliding-window layers keep only their window.

Why: Gemma 3's local layers (five of six) see the last 1,024 positions, yet the plain layout stores every
layer's KV for the whole context, so a 32k-token request holds about six times the KV those layers can ever
read. As vLLM V1's hybrid allocator and SGLang's SWA pool do, this layout keeps two groups of blocks, each a
`BlockManager` with its own pool:

- the **full group** (`full`): the full-attention layers' blocks, a sequence's `block_table`, for the whole
  context, with everything the plain layout does;
- the **window group** (`window`): the sliding layers' blocks, a sequence's `window_table`, numbered like
  `block_table` (entry j holds positions j*bs ...), whose entries behind the window are holes (`HOLE`):
  released, and findable in the group's own prefix cache until reused.

A step goes ahead only where both groups have room: each capacity question is asked of both, each with its
own watermark. The worker sees one id space: window-group device blocks are numbered after the full
group's, and its host blocks after the full group's host blocks (`window_offset`, `host_offset`), so a
swap or copy order names its pool by its ids (`worker/executor.py` splits them).

The window group fills ahead of the prompt, not all at once: a prompt's window table covers the next
`chunk_tokens` slots (the most a step computes), so a long prompt holds its window plus one chunk, never the
whole prompt. A prefix hit of k blocks counts only as far as the window group still holds the window before
it: the full group's hit is cut back to the longest such k. The prefix cache's lower tiers (host RAM, disk)
are off in this layout (a tier block would hold one group's layers only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seqs
from contextlib import contextmanager
from dataclasses import dataclass

from streamd.engine.core.block_manager import BlockManager, CopyPairs
from streamd.engine.core.kv_tiers import CachedBlock, TierOrders
from streamd.engine.core.sequence import Sequence
from streamd.engine.stats import KVCacheStats


@dataclass(slots=True)
class WindowSide:
    """A sequence as the window group sees it: its `window_table` is the group's `block_table`."""

    seq: Sequence

    @property
    def block_table(self) -> list[int]:
        return self.seq.window_table

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.seq.window_table = table

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_tokens(self) -> int:
        return self.seq.num_tokens

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def prefix_root(self) -> int:
        return self.seq.prefix_root


def _sides(seqs: Iterable[Sequence]) -> list[WindowSide]:
    return [WindowSide(seq) for seq in seqs]


class HybridBlockManager:
    """The full group and the window group behind the one interface the scheduler uses (`BlockManager`'s)."""

    follows_progress = True  # the window moves on with every block a sequence completes
    tier = None  # (the lower tiers are off in this layout)

    def __init__(self, full: BlockManager, window: BlockManager, sliding_window: int, chunk_tokens: int) -> None:
        if full.block_size != window.block_size:
            raise ValueError("both groups of the hybrid layout use one block size")
        self.full = full
        self.window = window
        self.sliding_window = sliding_window
        self.chunk_tokens = chunk_tokens
        self.block_size = full.block_size
        self.window_offset = full.num_blocks
        self.host_offset = full.num_swap_blocks
        # A lone prompt must always be able to go on: its window, one chunk ahead, and the boundary blocks.
        least = window.blocks_needed(sliding_window + chunk_tokens) + 2
        if window.num_blocks - window.watermark_blocks < least:
            raise ValueError(
                f"the sliding-window layers' pool has {window.num_blocks} blocks; one prompt needs {least} "
                f"(its window of {sliding_window} and a chunk of {chunk_tokens} tokens): raise the KV cache "
                "size or cache.swa_full_tokens_ratio, or lower scheduler.max_num_batched_tokens"
            )

    # ---- what the scheduler reads -----------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_swap_blocks(self) -> int:
        return self.full.num_swap_blocks

    @property
    def watermark_blocks(self) -> int:
        return self.full.watermark_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self.full.enable_prefix_caching

    @property
    def prefix_cache_queried_tokens(self) -> int:
        return self.full.prefix_cache_queried_tokens

    @prefix_cache_queried_tokens.setter
    def prefix_cache_queried_tokens(self, value: int) -> None:
        self.full.prefix_cache_queried_tokens = value

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.full.prefix_cache_hit_tokens

    @prefix_cache_hit_tokens.setter
    def prefix_cache_hit_tokens(self, value: int) -> None:
        self.full.prefix_cache_hit_tokens = value

    @property
    def device_hit_blocks(self) -> int:
        return self.full.device_hit_blocks

    @device_hit_blocks.setter
    def device_hit_blocks(self, value: int) -> None:
        self.full.device_hit_blocks = value

    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks()

    def free_state(self) -> int:
        return self.full.num_free_blocks() * (self.window.num_blocks + 1) + self.window.num_free_blocks()

    def blocks_needed(self, num_tokens: int) -> int:
        return self.full.blocks_needed(num_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.full.can_ever_fit(num_tokens)

    def worst_case_blocks(self, num_prompt_tokens: int, max_output_tokens: int, width: int) -> int:
        return self.full.worst_case_blocks(num_prompt_tokens, max_output_tokens, width)

    # ---- admission ------------------------------------------------------------------------------

    def can_allocate(self, seqs: Iterable[Sequence], reserve: int | None = None, reuse_prefix: bool = True) -> bool:
        full_need = window_need = 0
        for seq in seqs:
            hits = self.full.prefix_hits(seq, reuse_prefix)
            first, window_hits = self._usable_hits(seq, len(hits))
            num_hits = first + len(window_hits)
            full_need += self.full.allocation_cost(seq, hits[:num_hits])
            window_need += self.window.window_cost(first, window_hits, self._cover_to(seq, num_hits))
        reserve = self.full.watermark_blocks if reserve is None else reserve
        window_reserve = self.window.watermark_blocks if reserve else 0
        return (
            self.full.num_free_blocks() - full_need >= reserve
            and self.window.num_free_blocks() - window_need >= window_reserve
        )

    def allocate(self, seq: Sequence, reuse_prefix: bool = True, ahead: bool = False) -> int:
        """Both groups' blocks for `seq` (the full group's for all its tokens, the window group's for its
        window and one chunk ahead); returns the cached token count, as `BlockManager.allocate`."""
        hits = self.full.prefix_hits(seq, reuse_prefix)
        first, window_hits = self._usable_hits(seq, len(hits))
        num_hits = first + len(window_hits)
        cached = self.full.allocate(seq, reuse_prefix, ahead, hits=hits[:num_hits])
        self.window.allocate_window(WindowSide(seq), first, window_hits, self._cover_to(seq, num_hits))
        return cached

    def _usable_hits(self, seq: Sequence, num_hits: int) -> tuple[int, list[int]]:
        """The longest k <= `num_hits` whose window (the blocks a query at position k * bs can see) the window
        group still holds, as (index of its first block, those blocks)."""
        side, bs, lookups = WindowSide(seq), self.block_size, dict[int, int | None]()

        def cached(index: int) -> int | None:
            if index not in lookups:
                lookups[index] = self.window.cached_block(side, index)
            return lookups[index]

        k = num_hits
        while k > 0:
            first = self._first_needed(k * bs)
            missing = next((i for i in range(k - 1, first - 1, -1) if cached(i) is None), None)
            if missing is None:
                return first, [block for i in range(first, k) if (block := cached(i)) is not None]
            k = missing
        return 0, []

    def _first_needed(self, position: int) -> int:
        """The first block a query at `position` (and every later one) sees."""
        return max(0, position - self.sliding_window + 1) // self.block_size

    def _cover_to(self, seq: Sequence, num_hits: int) -> int:
        """The slot the window group covers up to for a prompt whose first `num_hits` blocks are cached."""
        return min(seq.num_tokens, num_hits * self.block_size + self.chunk_tokens)

    # ---- growth ---------------------------------------------------------------------------------

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.full.can_append(seq, num_new_tokens) and self.window.can_append(WindowSide(seq), num_new_tokens)

    def can_append_all(self, seqs: Seqs[Sequence]) -> bool:
        return self.full.can_append_all(seqs) and self.window.can_append_all(_sides(seqs))

    def try_append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> CopyPairs | None:
        """Both groups' slots, or None with nothing changed (the window group's room is checked first: the
        full group's append is the one that cannot be taken back)."""
        side = WindowSide(seq)
        if self.window.blocks_to_append(side, num_new_tokens) > self.window.num_free_blocks():
            return None
        copies = self.full.try_append_slots(seq, num_new_tokens)
        if copies is None:
            return None
        return copies + self._window_copies(self.window.append_slots(side, num_new_tokens))

    def append_slots(self, seq: Sequence, num_new_tokens: int = 1) -> CopyPairs:
        copies = self.full.append_slots(seq, num_new_tokens)
        return copies + self._window_copies(self.window.append_slots(WindowSide(seq), num_new_tokens))

    def try_cover_prompt(self, seq: Sequence) -> CopyPairs | None:
        """A running prompt's window table one chunk ahead, or None (no room; nothing changed)."""
        copies = self.window.try_append_slots(WindowSide(seq), self._ahead(seq))
        return None if copies is None else self._window_copies(copies)

    def can_cover_prompts(self, seqs: Seqs[Sequence]) -> bool:
        need = sum(self.window.blocks_to_append(WindowSide(seq), self._ahead(seq)) for seq in seqs)
        return need <= self.window.num_free_blocks()

    def cover_prompts(self, seqs: Seqs[Sequence]) -> CopyPairs:
        copies: CopyPairs = ()
        for seq in seqs:
            copies += self._window_copies(self.window.append_slots(WindowSide(seq), self._ahead(seq)))
        return copies

    def _ahead(self, seq: Sequence) -> int:
        return min(seq.num_tokens - seq.num_computed_tokens, self.chunk_tokens)

    def _window_copies(self, copies: CopyPairs) -> CopyPairs:
        offset = self.window_offset
        return tuple((src + offset, dst + offset) for src, dst in copies)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        self.full.truncate(seq, num_tokens)
        self.window.truncate(WindowSide(seq), num_tokens)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.full.fork(parent, child)
        self.window.fork(WindowSide(parent), WindowSide(child))

    def free(self, seq: Sequence) -> None:
        self.full.free(seq)
        self.window.free(WindowSide(seq))

    # ---- progress and the prefix cache ------------------------------------------------------------

    def mark_computed(self, seq: Sequence) -> None:
        """Registers both groups' newly full blocks, then gives back the window blocks no later query sees."""
        side = WindowSide(seq)
        if self.full.enable_prefix_caching:
            self.full.mark_computed(seq)
            self.window.mark_computed(side)
        self.window.release_behind(side, self._first_needed(seq.num_computed_tokens))

    def publish_in_step(self, seq: Sequence, upto: int) -> None:
        self.full.publish_in_step(seq, upto)

    def end_step(self) -> None:
        self.full.end_step()

    def reading_ahead(self, seqs: Iterable[Sequence]) -> bool:
        return False

    def restoring_ahead(self, seq: Sequence) -> bool:
        return False

    def take_tier_orders(self) -> TierOrders | None:
        return None

    @contextmanager
    def tiers_off(self) -> Iterator[None]:
        yield

    def persist_order(self) -> list[CachedBlock]:
        return []

    # ---- swapping -------------------------------------------------------------------------------

    def unique_blocks(self, seqs: Iterable[Sequence]) -> int:
        seqs = list(seqs)
        return self.full.unique_blocks(seqs) + self.window.unique_blocks(_sides(seqs))

    def can_swap_out(self, seqs: Iterable[Sequence]) -> bool:
        seqs = list(seqs)
        return self.full.can_swap_out(seqs) and self.window.can_swap_out(_sides(seqs))

    def swap_out(self, seqs: Seqs[Sequence]) -> list[tuple[int, int]]:
        pairs = self.full.swap_out(seqs)
        dev, host = self.window_offset, self.host_offset
        return pairs + [(d + dev, h + host) for d, h in self.window.swap_out(_sides(seqs))]

    def blocks_to_swap_in(self, seqs: Iterable[Sequence]) -> int:
        return self.full.blocks_to_swap_in(seqs)

    def can_swap_in(self, seqs: Iterable[Sequence], reserve: int | None = None) -> bool:
        seqs = list(seqs)
        sides = _sides(seqs)
        prompts = [side for side in sides if side.num_tokens - side.num_computed_tokens > 1]
        window_need = self.window.blocks_to_swap_in(sides) + len(prompts) * (self._ahead_blocks() + 1)
        window_reserve = self.window.watermark_blocks if reserve is None or reserve else 0
        return self.full.can_swap_in(seqs, reserve) and self.window.num_free_blocks() - window_need >= window_reserve

    def _ahead_blocks(self) -> int:
        return self.window.blocks_needed(self.chunk_tokens)

    def swap_in(self, seqs: Seqs[Sequence]) -> list[tuple[int, int]]:
        """Both groups' blocks back; `can_swap_in` also kept room for the prompts' chunk ahead
        (`cover_prompts`, which the scheduler calls next)."""
        pairs = self.full.swap_in(seqs)
        dev, host = self.window_offset, self.host_offset
        return pairs + [(h + host, d + dev) for h, d in self.window.swap_in(_sides(seqs))]

    # ---- observability --------------------------------------------------------------------------

    def ref_count(self, block: int) -> int:
        return self.full.ref_count(block)

    def findable_blocks(self) -> dict[int, int]:
        return self.full.findable_blocks()

    def stats(self) -> KVCacheStats:
        window = self.window
        return dataclasses.replace(
            self.full.stats(),
            window_blocks_total=window.num_blocks,
            window_blocks_free=window.num_free_blocks(),
            window_block_bytes=window.block_bytes,
            window_swap_blocks_total=window.num_swap_blocks,
            window_swap_blocks_free=window.num_free_swap_blocks(),
        )

    def check_invariants(self, seqs: Iterable[Sequence]) -> None:
        seqs = list(seqs)
        self.full.check_invariants(seqs)
        self.window.check_invariants(_sides(seqs))


BlockSpace = BlockManager | HybridBlockManager
"""What the scheduler holds: the plain layout's one group, or the hybrid layout's two."""
