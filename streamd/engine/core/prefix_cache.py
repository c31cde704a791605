"""PrefixCache: the index that makes full KV blocks findable by content (paper §4.4, "Shared prefix").

It owns the mapping hash -> physical device block and, per registered block, the hash, the parent
hash and the token ids it was registered with. A block's hash is xxh64 of (parent block's hash, its
token ids), so equal hashes mean equal prefixes up to and including the block; a hit is still confirmed
by comparing the parent hash and the token ids, because 64-bit hashes can collide. The BlockManager
decides *when* a block is registered (only after its KV is written) and when it is forgotten (when the
free block is reused). Plain Python, no torch.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import xxhash

from streamd.engine.core.kv_tiers import BlockKey

# Parent "hash" of a sequence's first block. Any fixed value works: the hit is confirmed anyway.
ROOT_HASH = 0


def prefix_root(cache_salt: str | None, tenant: str | None) -> int:
    """The parent hash of a sequence's first block: ROOT_HASH (one cache for all) unless a `cache_salt` or
    an isolated `tenant` (`cache.prefix_isolation = "tenant"`) separates its chain from everyone else's.
    The hit check compares parents, so a separate root can never match another root's blocks."""
    if cache_salt is None and tenant is None:
        return ROOT_HASH
    key = f"{tenant or ''}\0{cache_salt or ''}".encode()
    return xxhash.xxh64_intdigest(key) or 1  # never ROOT_HASH itself


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    """Chained content hash of one full block."""
    # 'q' (int64) so any token id fits; the parent goes first so equal blocks after different
    # prefixes get different hashes.
    return xxhash.xxh64_intdigest(parent_hash.to_bytes(8, "little") + array("q", token_ids).tobytes())


@dataclass(slots=True)
class SeqHashes:
    """One sequence's hash chain: hashes of its first len(hashes) full blocks, computed once each
    (full blocks never change), and how many leading blocks were offered to the cache (KV written)."""

    block_size: int
    hashes: list[int] = field(default_factory=list)
    num_committed: int = 0
    root: int = ROOT_HASH  # the first block's parent (`prefix_root`)

    def block_hash(self, token_ids: list[int], index: int) -> int:
        hashes, bs = self.hashes, self.block_size
        while len(hashes) <= index:
            j = len(hashes)
            hashes.append(hash_block(hashes[j - 1] if j else self.root, token_ids[j * bs : (j + 1) * bs]))
        return hashes[index]

    def parent(self, index: int) -> int:
        return self.hashes[index - 1] if index else self.root

    def copy(self) -> SeqHashes:
        return SeqHashes(self.block_size, list(self.hashes), self.num_committed, self.root)


class PrefixCache:
    """hash -> block index over `num_blocks` device blocks."""

    __slots__ = ("_by_hash", "_hash", "_parent", "_tokens")

    def __init__(self, num_blocks: int) -> None:
        self._by_hash: dict[int, int] = {}
        # Per block; None when the block is not registered.
        self._hash: list[int | None] = [None] * num_blocks
        self._parent: list[int] = [ROOT_HASH] * num_blocks
        self._tokens: list[list[int] | None] = [None] * num_blocks

    def lookup(self, block_hash: int, parent_hash: int, token_ids: list[int]) -> int | None:
        """The block holding exactly this content after exactly this prefix, or None."""
        block = self._by_hash.get(block_hash)
        if block is None or self._parent[block] != parent_hash or self._tokens[block] != token_ids:
            return None
        return block

    def register(self, block: int, block_hash: int, parent_hash: int, token_ids: list[int]) -> bool:
        """Makes `block` findable. A second block with the same content (two requests computed the
        same prefix at once) stays unregistered; returns whether `block` was registered."""
        if block_hash in self._by_hash or self._hash[block] is not None:
            return False
        self._by_hash[block_hash] = block
        self._hash[block] = block_hash
        self._parent[block] = parent_hash
        self._tokens[block] = token_ids
        return True

    def find(self, chain: SeqHashes, token_ids: list[int], index: int) -> int | None:
        """The block holding block `index` of the sequence `chain` and `token_ids` describe."""
        bs = chain.block_size
        block_hash = chain.block_hash(token_ids, index)
        return self.lookup(block_hash, chain.parent(index), token_ids[index * bs : (index + 1) * bs])

    def match(self, chain: SeqHashes, token_ids: list[int], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached prefix, at most `max_blocks` of them."""
        hits = []
        for index in range(max_blocks):
            block = self.find(chain, token_ids, index)
            if block is None:
                break
            hits.append(block)
        return hits

    def commit(self, chain: SeqHashes, token_ids: list[int], table: list[int], num_full: int) -> None:
        """Registers the sequence's blocks up to `num_full` (their KV is written)."""
        bs = chain.block_size
        for index in range(chain.num_committed, num_full):
            block_hash = chain.block_hash(token_ids, index)
            self.register(table[index], block_hash, chain.parent(index), token_ids[index * bs : (index + 1) * bs])
        chain.num_committed = max(chain.num_committed, num_full)

    def is_registered(self, block: int) -> bool:
        return self._hash[block] is not None

    def forget(self, block: int) -> None:
        """The block is about to be overwritten: it is no longer findable."""
        block_hash = self._hash[block]
        if block_hash is None:
            return
        del self._by_hash[block_hash]
        self._hash[block] = None
        self._tokens[block] = None

    def registered(self) -> dict[int, int]:
        """A copy of hash -> block (for invariant checks and tests)."""
        return dict(self._by_hash)

    def key_of(self, block: int) -> BlockKey | None:
        """The content key of a registered block (what a lower tier files it under), None for an unregistered one."""
        block_hash, tokens = self._hash[block], self._tokens[block]
        if block_hash is None or tokens is None:
            return None
        return BlockKey(block_hash, self._parent[block], tuple(tokens))

    def tokens_of(self, block: int) -> list[int] | None:
        return self._tokens[block]
