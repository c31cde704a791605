"""DiskTier: KV blocks as files in `cache.disk_cache_dir`, so prefixes survive eviction and restarts.

Each block is one file `<dir>/<layout digest>/<block hash>.kv`: a fixed header (magic, layout digest,
block hash, parent hash, payload checksum, token count, payload size), the block's token ids, then its
bytes. The layout digest covers everything the bytes depend on (model, dtype, block size, KV layout,
tensor-parallel degree, KV dtype), so a server with another model or layout never reads them. At start
the directory is indexed again from the headers (most recently used last, by modification time); a file
that is truncated, foreign (another layout's digest) or unreadable is skipped with a log line, never
loaded. The payload's checksum is verified on every read, so a tampered file is caught and dropped
before its bytes reach the pool (the block is then recomputed: the output is unchanged).

Writes go through one background thread (the engine thread only hands the bytes over); until a block's
file is written its bytes stay in memory and reads find them there. The total is bounded by
`cache.disk_cache_gib`, least recently used evicted first. Plain Python, no torch.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import xxhash

from streamd.engine.core.kv_tiers import BlockKey
from streamd.engine.stats import TierStats
from streamd.logs import get_logger

log = get_logger(__name__)

MAGIC = b"STRMDKV1"
_HEADER = struct.Struct("<8sQQQQII")  # magic, layout digest, block hash, parent hash, checksum, tokens, payload
_U64 = (1 << 64) - 1
_MAX_PENDING_BYTES = 256 << 20  # bytes handed to the writer and not yet on disk; beyond it a spill is dropped
_EMA = 0.2  # weight of a new read time in the measured read seconds per block
_PROBES = 5  # start-up reads of a scratch block; the fastest is the estimate (contention only adds time)
_RETRY_EVERY = 64  # while reading loses to recomputing, every 64th admission reads anyway, to measure again


def layout_digest(description: str) -> int:
    """The 64-bit digest naming one KV layout (`description` lists what the bytes depend on)."""
    return xxhash.xxh64_intdigest(description.encode())


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    size: int  # bytes of the file


class DiskTier:
    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        layout: str,
        block_bytes: int,
        recompute_s_per_block: float | None = None,
    ) -> None:
        """`layout`: the description `layout_digest` turns into the directory's name; `recompute_s_per_block`:
        the prefill time of one block (None: always read)."""
        self.digest = layout_digest(layout)
        self.directory = Path(directory) / f"{self.digest:016x}"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.capacity_bytes = capacity_bytes
        self.recompute_s_per_block = recompute_s_per_block
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # block hash -> entry, least recent first
        self._used_bytes = 0
        self._pending: dict[int, bytes] = {}  # block hash -> bytes not yet written
        self._pending_bytes = 0
        self._lock = threading.Lock()  # guards _pending against the writer thread
        self._jobs: queue.Queue[tuple[str, int, Path] | None] = queue.Queue()
        self.hit_blocks = self.bytes_read = self.bytes_written = self.skipped_files = self.dropped_spills = 0
        self._refusals = 0  # admissions told not to read since the last read
        self.read_s_per_block = self._probe_read()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="streamd-disk-tier", daemon=True)
        self._writer.start()
        log.info(
            "disk_tier.opened",
            directory=str(self.directory),
            blocks=len(self._entries),
            gib=round(self._used_bytes / 2**30, 3),
            capacity_gib=round(capacity_bytes / 2**30, 3),
            read_ms_per_block=round(self.read_s_per_block * 1e3, 3),
            recompute_ms_per_block=None if recompute_s_per_block is None else round(recompute_s_per_block * 1e3, 3),
            skipped_files=self.skipped_files,
        )

    # ---- the tier -------------------------------------------------------------------------------

    def contains(self, key: BlockKey) -> bool:
        entry = self._entries.get(key.block_hash)
        return entry is not None and entry.key == key

    def worth_reading(self) -> bool:
        """Whether reading a block beats recomputing it, as last measured. A refusal is not final: reads are
        measured only when they happen, so every `_RETRY_EVERY`-th refused admission reads anyway, and a slow
        spell (a contended disk or CPU) cannot keep the tier shut after it passed."""
        if self.recompute_s_per_block is None or self.read_s_per_block < self.recompute_s_per_block:
            return True
        self._refusals = (self._refusals + 1) % _RETRY_EVERY
        return self._refusals == 0

    def fetch(self, key: BlockKey) -> bytes | None:
        if not self.contains(key):
            return None
        with self._lock:
            payload = self._pending.get(key.block_hash)
        if payload is None:
            payload = self._read(key)
            if payload is None:
                self._forget(key.block_hash)
                return None
        self._entries.move_to_end(key.block_hash)
        self.hit_blocks += 1
        return payload

    def put(self, key: BlockKey, payload: bytes) -> None:
        if self.contains(key):
            self._entries.move_to_end(key.block_hash)
            return
        size = _HEADER.size + 8 * len(key.token_ids) + len(payload)
        if size > self.capacity_bytes or self._pending_bytes + len(payload) > _MAX_PENDING_BYTES:
            self.dropped_spills += 1
            return
        self._forget(key.block_hash)  # a colliding hash with other content: the newer content wins
        while self._used_bytes + size > self.capacity_bytes:
            self._forget(next(iter(self._entries)))
        self._entries[key.block_hash] = _Entry(key, size)
        self._used_bytes += size
        with self._lock:
            self._pending[key.block_hash] = payload
            self._pending_bytes += len(payload)
        self._jobs.put(("write", key.block_hash, self._path(key.block_hash)))

    def stats(self) -> TierStats:
        return TierStats(
            "disk",
            len(self._entries),
            self.hit_blocks,
            self.bytes_read,
            self.bytes_written,
            self.skipped_files,
        )

    def flush(self) -> None:
        """Waits until every handed-over block is on disk (tests, shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        self.flush()
        self._jobs.put(None)
        self._writer.join()

    def check_invariants(self) -> None:
        """Raises AssertionError unless the index and the directory agree once the writes are done (the leak
        check: no file without an entry, no entry without its file, the bound's bytes exact and kept)."""
        self.flush()
        files = {path.name: path.stat().st_size for path in self.directory.glob("*.kv")}
        indexed = {self._path(h).name: entry.size for h, entry in self._entries.items()}
        assert files == indexed, f"disk tier: index and files differ ({len(indexed)} indexed, {len(files)} files)"
        assert self._used_bytes == sum(indexed.values()) <= self.capacity_bytes, "disk tier: bytes miscounted"
        assert not self._pending and self._pending_bytes == 0, "disk tier: written blocks still held in memory"

    # ---- the index ------------------------------------------------------------------------------

    def _path(self, block_hash: int) -> Path:
        return self.directory / f"{block_hash:016x}.kv"

    def _forget(self, block_hash: int) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return
        self._used_bytes -= entry.size
        with self._lock:
            payload = self._pending.pop(block_hash, None)
            if payload is not None:
                self._pending_bytes -= len(payload)
        self._jobs.put(("delete", block_hash, self._path(block_hash)))

    def _scan(self) -> None:
        """Indexes the files a previous server left, oldest first; skips what cannot be this layout's block."""
        files = []
        for path in self.directory.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)  # a write cut short by a crash
            elif path.suffix == ".kv":
                files.append((path.stat().st_mtime, path))
        for _, path in sorted(files):
            entry = self._read_header(path)
            if entry is None:
                continue
            while self._used_bytes + entry.size > self.capacity_bytes and self._entries:
                self._forget(next(iter(self._entries)))
            self._entries[entry.key.block_hash] = entry
            self._used_bytes += entry.size

    def _read_header(self, path: Path) -> _Entry | None:
        try:
            with path.open("rb") as f:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    self._skip(path, "truncated header")
                    return None
                magic, digest, block_hash, parent, _, num_tokens, payload_len = _HEADER.unpack(head)
                if magic != MAGIC or digest != self.digest:
                    self._skip(path, "foreign file (another format or KV layout)")
                    return None
                tokens = array("q")
                tokens.frombytes(f.read(8 * num_tokens))
            size = path.stat().st_size
        except (OSError, ValueError) as exc:
            self._skip(path, f"unreadable: {exc}")
            return None
        expected = _HEADER.size + 8 * num_tokens + payload_len
        if payload_len != self.block_bytes or size != expected or path.name != f"{block_hash:016x}.kv":
            self._skip(path, f"truncated or misnamed ({size} bytes, {expected} expected)")
            return None
        return _Entry(BlockKey(block_hash, parent, tuple(tokens)), size)

    def _skip(self, path: Path, why: str) -> None:
        """Logs a file that is not used (its entry, if any, is dropped by the caller)."""
        self.skipped_files += 1
        log.warning("disk_tier.file_skipped", path=str(path), reason=why)

    # ---- the bytes ------------------------------------------------------------------------------

    def _read(self, key: BlockKey) -> bytes | None:
        """The block's payload from its file, checked against the header and its checksum."""
        path = self._path(key.block_hash)
        began = time.perf_counter()
        try:
            data = path.read_bytes()
        except OSError as exc:
            self._skip(path, f"unreadable: {exc}")
            return None
        head_size = _HEADER.size + 8 * len(key.token_ids)
        if len(data) != head_size + self.block_bytes:
            self._skip(path, f"truncated ({len(data)} bytes, {head_size + self.block_bytes} expected)")
            return None
        magic, digest, block_hash, parent, checksum, num_tokens, _ = _HEADER.unpack_from(data)
        payload = data[head_size:]
        stored = BlockKey(block_hash, parent, tuple(array("q", data[_HEADER.size : head_size])))
        if (magic, digest, num_tokens) != (MAGIC, self.digest, len(key.token_ids)) or stored != key:
            self._skip(path, "header does not match the index")
            return None
        if xxhash.xxh64_intdigest(payload) != checksum:
            self._skip(path, "payload checksum mismatch (tampered or corrupt)")
            return None
        elapsed = time.perf_counter() - began
        self.read_s_per_block += _EMA * (elapsed - self.read_s_per_block)
        self.bytes_read += len(data)
        return payload

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._do(*job)
            except OSError as exc:
                log.warning("disk_tier.io_failed", op=job[0], path=str(job[2]), error=str(exc))
            finally:
                self._jobs.task_done()
        self._jobs.task_done()

    def _do(self, op: str, block_hash: int, path: Path) -> None:
        if op == "delete":
            # A block evicted and put back before this job ran is indexed again: its file is the new one's
            # (an earlier write job may already have written the new bytes), so it stays.
            if block_hash not in self._entries:
                path.unlink(missing_ok=True)
            return
        with self._lock:
            payload = self._pending.get(block_hash)
        entry = self._entries.get(block_hash)
        if payload is None or entry is None:
            return  # evicted before it was written
        self._write_file(path, entry.key, payload)
        with self._lock:
            if self._pending.get(block_hash) is payload:
                del self._pending[block_hash]
                self._pending_bytes -= len(payload)

    def _write_file(self, path: Path, key: BlockKey, payload: bytes) -> None:
        header = _HEADER.pack(
            MAGIC,
            self.digest,
            key.block_hash & _U64,
            key.parent_hash & _U64,
            xxhash.xxh64_intdigest(payload),
            len(key.token_ids),
            len(payload),
        )
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(header)
            f.write(array("q", key.token_ids).tobytes())
            f.write(payload)
        os.replace(tmp, path)
        self.bytes_written += len(header) + 8 * len(key.token_ids) + len(payload)

    def _probe_read(self) -> float:
        """Seconds to read and check one block's file here (a scratch file of that size, read back): the
        fastest of a few reads, since another process's burst only ever adds time, and one burst at start
        must not decide that reading loses."""
        probe = self.directory / "read-probe.tmp"
        probe.write_bytes(os.urandom(self.block_bytes))
        fastest = float("inf")
        for _ in range(_PROBES):
            began = time.perf_counter()
            xxhash.xxh64_intdigest(probe.read_bytes())
            fastest = min(fastest, time.perf_counter() - began)
        probe.unlink(missing_ok=True)
        return fastest
