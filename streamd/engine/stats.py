"""Typed statistics of the engine's parts, read by name (a misspelled field fails instead of reading 0).

`KVCacheStats` comes from the block manager, `SchedulerStats` from the scheduler, and `EngineStats` joins
them with the engine's own counts; `/metrics`, the benchmarks and the tests read these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class TierStats:
    """One lower tier of the prefix cache (`core/kv_tiers.py`): the `tier` label of its metrics."""

    name: str
    blocks: int  # blocks the tier holds now
    hit_blocks: int  # cumulative blocks restored from it
    bytes_read: int  # cumulative
    bytes_written: int  # cumulative
    skipped_files: int = 0  # corrupt or foreign entries skipped (never loaded)


@dataclass(slots=True, frozen=True)
class KVCacheStats:
    blocks_total: int
    blocks_free: int
    blocks_cached: int  # free blocks that still hold a findable prefix
    swap_blocks_total: int
    swap_blocks_free: int
    swapped_out_blocks: int  # cumulative
    swapped_in_blocks: int  # cumulative
    prefix_queried_tokens: int  # cumulative prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int  # cumulative prompt tokens found there
    allocated_blocks: int  # cumulative blocks taken off the free lists (sharing a block allocates nothing)
    copied_blocks: int  # cumulative copy-on-write copies
    device_hit_blocks: int = 0  # cumulative prefix blocks found on the device (tier hits: `tiers`)
    tiers: list[TierStats] = field(default_factory=list)  # the prefix cache's lower tiers (disk)
    block_bytes: int = 0  # one block's bytes (0: not known)
    # The hybrid layout's sliding-window layers (`core/hybrid_blocks.py`); zeros without it
    window_blocks_total: int = 0
    window_blocks_free: int = 0
    window_block_bytes: int = 0
    window_swap_blocks_total: int = 0
    window_swap_blocks_free: int = 0

    @property
    def blocks_used(self) -> int:
        return self.blocks_total - self.blocks_free

    @property
    def window_blocks_used(self) -> int:
        return self.window_blocks_total - self.window_blocks_free

    @property
    def bytes_used(self) -> int:
        """The KV bytes held by live sequences, both groups of the hybrid layout (0 where not known)."""
        return self.blocks_used * self.block_bytes + self.window_blocks_used * self.window_block_bytes

    @property
    def swap_blocks_used(self) -> int:
        return self.swap_blocks_total - self.swap_blocks_free


DEFAULT_TENANT = "default"  # the server's tenant of a request that names nobody (no key, no user)


@dataclass(slots=True, frozen=True)
class TenantStats:
    """One tenant's share (engine/core/fairness.py); `name` is the request's `tenant`, never a raw key."""

    name: str
    prompt_tokens: int  # cumulative prompt tokens computed (recomputes included)
    output_tokens: int  # cumulative output tokens decoded
    preemptions: int  # cumulative
    virtual_tokens: float  # its fair-share counter (weighted tokens over its weight)
    admissions: int = 0  # cumulative requests scheduled for the first time
    queue_seconds: float = 0.0  # their summed waits from arrival to first scheduling


# The additive tallies of a tenant (`TenantStats`, the fair share's `Tenant`, the server's per-label totals):
# summed field by field wherever tenants are merged (forgotten tenants, the "other" row, a label's tenants).
TENANT_TALLIES = ("prompt_tokens", "output_tokens", "preemptions", "admissions", "queue_seconds")


def add_tallies(into: object, source: object) -> None:
    """Adds `source`'s TENANT_TALLIES to `into`'s (mutable records with those fields)."""
    for name in TENANT_TALLIES:
        setattr(into, name, getattr(into, name) + getattr(source, name))


@dataclass(slots=True, frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    preemptions_swap: int  # cumulative
    preemptions_recompute: int  # cumulative
    recomputed_tokens: int  # cumulative tokens prefilled again after recompute preemption
    num_paused: int = 0  # requests not scheduled because their reader fell behind (they keep their blocks)
    # The named tenants (`FairShare.named`), then the others most served first, past 16 the rest as "other"
    tenants: list[TenantStats] = field(default_factory=list)
    spec_draft_tokens: int = 0  # cumulative draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # cumulative draft tokens accepted


@dataclass(slots=True, frozen=True)
class EngineStats:
    kv: KVCacheStats
    scheduler: SchedulerStats
    num_requests: int  # requests the engine holds (waiting, running, swapped)
    generated_tokens: int  # cumulative output tokens sampled and kept (the engine view's tokens/s)
    grammar_cache_bytes: int = 0  # compiled grammars cached (bounded by grammar.cache_bytes)
    cpu_threads: int = 0  # torch's threads the forward runs on now (0: the model is not on the CPU)

    @property
    def pool_whole(self) -> bool:
        """Every device and host block is free (the leak check once no request is in flight)."""
        kv = self.kv
        return (
            kv.blocks_free == kv.blocks_total
            and kv.swap_blocks_free == kv.swap_blocks_total
            and kv.window_blocks_free == kv.window_blocks_total
            and kv.window_swap_blocks_free == kv.window_swap_blocks_total
        )
