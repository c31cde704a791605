"""The prefix cache's lower tiers: where a full KV block goes when the device LRU evicts it, and where
admission looks after the device's prefix cache stops matching (issue 31).

A chatbot's long system prompt and each conversation's history are evicted from the device by other
traffic and recomputed on return; a lower tier keeps them. The BlockManager (plain Python) decides what
moves: when it evicts a registered device block it orders a *spill* (the block's bytes handed to the tier
under its `BlockKey`), and when admission's chain continues in the tier it orders a *restore* (the tier's
bytes into a freshly allocated device block, before the forward that reads them). The CacheEngine moves
the bytes; the tier owns its index and storage (`disk_tier.DiskTier`). A tier is consulted only while
reading beats recomputing (`KVTier.worth_reading`).

At a graceful shutdown the tier takes what the device and the host tier still cache (`KVTier.persist`): the
BlockManager lists those blocks most valuable first (`CachedBlock`s), the engine reads their bytes batch by
batch, and the tier keeps as many as its bound holds within a time bound, so a restarted server finds the
prefixes it will be asked for first (issue 31's H200 run lost the system prompt: every block was handed to
the background writer least recently used first, and its in-memory bound dropped the most recent ones).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from streamd.engine.stats import TierStats


@dataclass(slots=True, frozen=True)
class BlockKey:
    """What identifies a block's content: its chained hash, confirmed by the parent hash and token ids
    (64-bit hashes can collide), as the device prefix cache confirms a hit."""

    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass(slots=True)
class TierOrders:
    """One step's moves between the device pool and the lower tier. Spills are read before anything in the
    step writes the device pool (their blocks are reused in it); restores are written before the forward (host
    restores ordered ahead: before the next step's)."""

    spills: list[tuple[int, BlockKey]]  # (device block, its content's key) to the disk tier
    restores: list[tuple[int, bytes]]  # (device block, the disk tier's bytes for it)
    # The host tier (host_tier.py), in the swap pool: copies like swap-outs and swap-ins, and host blocks
    # evicted from it on to the disk tier (read before any copy of the step writes the host pool).
    host_spills: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    host_restores: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # Host hits of a request admitted beside other work: copied in while the step's forward runs (no sequence
    # of this step reads them); the next step's forward waits for them.
    host_restores_ahead: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    host_to_disk: list[tuple[int, BlockKey]] = field(default_factory=list)  # (host block, its key)

    @classmethod
    def none(cls) -> TierOrders:
        return cls([], [])


@dataclass(slots=True, frozen=True)
class CachedBlock:
    """A block the prefix cache holds at shutdown: its content's key and where its bytes are."""

    key: BlockKey
    block: int  # a device block, or a host pool block when `on_host`
    on_host: bool = False


ReadBlocks = Callable[[list[CachedBlock]], list[bytes]]  # the bytes of each block, in order (the engine's reads)


@dataclass(slots=True, frozen=True)
class Persisted:
    """What a shutdown's `KVTier.persist` did with the cached blocks it was offered."""

    offered: int
    kept: int  # on disk already (now ranked most recent)
    written: int
    beyond_bound: int  # the least valuable, which the tier's bound could not hold
    cut_by_deadline: int  # within the bound, but the time bound ran out first
    seconds: float


class KVTier(Protocol):
    """A store of KV blocks by content (the disk tier; a host-RAM tier would be another)."""

    def contains(self, key: BlockKey) -> bool: ...

    def fetch(self, key: BlockKey) -> bytes | None:
        """The block's verified bytes, or None (absent, or found corrupt: then dropped with a log line)."""
        ...

    def put(self, key: BlockKey, payload: bytes) -> None: ...

    def read_ahead(self, keys: list[BlockKey]) -> bool:
        """Starts reading `keys` (a chain) into memory in the background; True while any is still being read."""
        ...

    def worth_reading(self) -> bool:
        """Whether restoring a block from here beats recomputing it (measured)."""
        ...

    def stats(self) -> TierStats: ...

    def persist(self, blocks: list[CachedBlock], read: ReadBlocks, timeout_s: float) -> Persisted:
        """At shutdown: keeps `blocks` (most valuable first) as far as the bound and `timeout_s` allow."""
        ...

    def close(self, timeout_s: float | None = None) -> None: ...
