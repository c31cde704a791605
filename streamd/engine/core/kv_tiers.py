"""The prefix cache's lower tiers: where a full KV block goes when the device LRU evicts it, and where
admission looks after the device's prefix cache stops matching (issue 31).

A chatbot's long system prompt and each conversation's history are evicted from the device by other
traffic and recomputed on return; a lower tier keeps them. The BlockManager (plain Python) decides what
moves: when it evicts a registered device block it orders a *spill* (the block's bytes handed to the tier
under its `BlockKey`), and when admission's chain continues in the tier it orders a *restore* (the tier's
bytes into a freshly allocated device block, before the forward that reads them). The CacheEngine moves
the bytes; the tier owns its index and storage (`disk_tier.DiskTier`). A tier is consulted only while
reading beats recomputing (`KVTier.worth_reading`).
"""

from __future__ import annotations

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
    step writes the device pool (their blocks are reused in it); restores are written before the forward."""

    spills: list[tuple[int, BlockKey]]  # (device block, its content's key) to the disk tier
    restores: list[tuple[int, bytes]]  # (device block, the disk tier's bytes for it)
    # The host tier (host_tier.py), in the swap pool: copies like swap-outs and swap-ins, and host blocks
    # evicted from it on to the disk tier (read before any copy of the step writes the host pool).
    host_spills: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    host_restores: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    host_to_disk: list[tuple[int, BlockKey]] = field(default_factory=list)  # (host block, its key)

    @classmethod
    def none(cls) -> TierOrders:
        return cls([], [])


class KVTier(Protocol):
    """A store of KV blocks by content (the disk tier; a host-RAM tier would be another)."""

    def contains(self, key: BlockKey) -> bool: ...

    def fetch(self, key: BlockKey) -> bytes | None:
        """The block's verified bytes, or None (absent, or found corrupt: then dropped with a log line)."""
        ...

    def put(self, key: BlockKey, payload: bytes) -> None: ...

    def worth_reading(self) -> bool:
        """Whether restoring a block from here beats recomputing it (measured)."""
        ...

    def stats(self) -> TierStats: ...

    def close(self) -> None: ...
