"""DiskTier: KV blocks as files in `cache.disk_cache_dir`, so prefixes survive eviction and restarts.

Each block is one file `<dir>/<layout digest>/<block hash>.kv`: a fixed header (magic, layout digest,
block hash, parent hash, payload checksum, token count, payload size), the block's token ids, then its
bytes. The layout digest covers everything the bytes depend on (the weights' identity, not only the model's
name; quantization, KV dtype, block size, KV layout, tensor-parallel degree: `builder.kv_description`), so a
server with another model or layout never reads them. At start
the directory is indexed again from the headers (most recently used last, by modification time); a file
that is truncated, foreign (another layout's digest) or unreadable is skipped with a log line, never
loaded. The payload's checksum is verified on every read, so a tampered file is caught and dropped
before its bytes reach the pool (the block is then recomputed: the output is unchanged).

Whether to read at all is measured (`worth_reading`): a start-up probe reads a chain of scratch blocks the
way a restore does, then every read is weighed in; the tier is read while that beats recomputing a block.

Reads a step ahead (`read_ahead`): reading a long chain inside the step that admits it stretched that step
(45 blocks, issue 31's target is no step beyond 1.2x the median). So while other work runs, admission does
not read: it asks a reader thread to read and check the chain into memory while the step runs (file reads
and the checksum release the GIL) and lets the request wait; a later step's admission takes the bytes from
memory. Chosen over a per-step read budget because the request waits only as long as its reads take (not
one budget's worth of blocks per step) and no step reads a file; with nothing else in the step, admission
reads at once (no batch waits on it). The engine thread alone updates the index, counters and read estimate:
the reader only hands results over (`_Staged`), bounded in bytes.

Writes go through one background thread (the engine thread only hands the bytes over); until a block's
file is written its bytes stay in memory and reads find them there. The total is bounded by
`cache.disk_cache_gib`, least recently used evicted first; the files other layouts (another model, dtype,
block size) left in the same directory count toward it and go first, oldest first (`_others`), so a model
switch cannot leave the old model's files beyond the bound for good. Plain Python, no torch.

At a graceful shutdown (`persist`) the cached blocks still on the device or in the host tier come here most
valuable first and are written on the closing thread, not handed to the writer (whose in-memory bound drops
spills): the bound's room is given down that list, so what does not fit is the least valuable, and the
writes stop at a time bound (`cache.disk_persist_timeout_s`), so a slow disk cannot hold a shutdown past
an orchestrator's grace period. The kept blocks then rank most recently used, in the index and, through
their files' modification times, in the next start's index.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from streamd.engine.core.kv_tiers import BlockKey, CachedBlock, Persisted, ReadBlocks
from streamd.engine.stats import TierStats
from streamd.logs import get_logger

log = get_logger(__name__)

MAGIC = b"STRMDKV1"
_HEADER = struct.Struct("<8sQQQQII")  # magic, layout digest, block hash, parent hash, checksum, tokens, payload
_U64 = (1 << 64) - 1
_MAX_PENDING_BYTES = 256 << 20  # bytes handed to the writer and not yet on disk; beyond it a spill is dropped
_MAX_STAGED_BYTES = 256 << 20  # bytes read ahead and not yet taken (the oldest go first); a chain of more than
# half of it is not read ahead (admission reads it itself), so read-ahead can never chase its own tail
_EMA = 0.2  # weight of a new read time in the measured read seconds per block
_PROBE_CHAIN = 8  # scratch blocks a start-up probe reads in a row, holding their payloads (as a restore does)
_PROBE_TOKENS = 16  # token ids in a scratch block's header
_PROBES = 3  # start-up chains read; the fastest one's time per block is the estimate (contention only adds time)
_RETRY_EVERY = 64  # while reading loses to recomputing, every 64th admission reads anyway, to measure again
_PERSIST_BATCH = 64  # blocks read out of the pools at once at shutdown (their bytes are held until written)
_RANK_STEP_NS = 1000  # at shutdown, kept files' modification times step down by this, most valuable newest
_timer = time.perf_counter  # what reads are timed by (a test makes them slow)


def layout_digest(description: str) -> int:
    """The 64-bit digest naming one KV layout (`description` lists what the bytes depend on)."""
    return xxhash.xxh64_intdigest(description.encode())


@dataclass(slots=True)
class _Entry:
    key: BlockKey
    size: int  # bytes of the file


@dataclass(slots=True)
class _Staged:
    """A block the reader read ahead: its payload, checked (None: why it is unusable), and the read's time."""

    key: BlockKey
    payload: bytes | None
    why: str
    seconds: float


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
        self._others: deque[tuple[Path, int]] = deque()  # other layouts' files (path, bytes), oldest first
        self._others_bytes = 0
        self._pending: dict[int, bytes] = {}  # block hash -> bytes not yet written
        self._pending_bytes = 0
        self._lock = threading.Lock()  # guards _pending, _staged and _in_flight against the two threads
        self._jobs: queue.Queue[tuple[str, int, Path] | None] = queue.Queue()
        self._staged: OrderedDict[int, _Staged] = OrderedDict()  # block hash -> read ahead, oldest first
        self._staged_bytes = 0
        self._in_flight: set[int] = set()  # block hashes handed to the reader and not staged yet
        self._reads: queue.Queue[BlockKey | None] = queue.Queue()
        self.hit_blocks = self.bytes_read = self.bytes_written = self.skipped_files = self.dropped_spills = 0
        self._refusals = 0  # admissions told not to read since the last read
        self._closed = False
        self.read_s_per_block = self._probe_read()
        self._reading = self._reading_pays()  # what `worth_reading` last found (its changes are logged)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="streamd-disk-tier", daemon=True)
        self._writer.start()
        self._scan_others()
        self._reader = threading.Thread(target=self._read_loop, name="streamd-disk-reader", daemon=True)
        self._reader.start()
        log.info(
            "disk_tier.opened",
            directory=str(self.directory),
            blocks=len(self._entries),
            gib=round(self._used_bytes / 2**30, 3),
            capacity_gib=round(capacity_bytes / 2**30, 3),
            read_ms_per_block=round(self.read_s_per_block * 1e3, 3),
            recompute_ms_per_block=None if recompute_s_per_block is None else round(recompute_s_per_block * 1e3, 3),
            reading=self._reading,
            skipped_files=self.skipped_files,
        )

    # ---- the tier -------------------------------------------------------------------------------

    def contains(self, key: BlockKey) -> bool:
        entry = self._entries.get(key.block_hash)
        return entry is not None and entry.key == key

    def worth_reading(self) -> bool:
        """Whether reading a block beats recomputing it, as last measured. A refusal is not final: reads are
        measured only when they happen, so every `_RETRY_EVERY`-th refused admission reads anyway, and a slow
        spell (a contended disk or CPU) cannot keep the tier shut after it passed. A change of the answer is
        logged (`disk_tier.reading_on` / `reading_off`, with both estimates): why a prefix was recomputed."""
        pays = self._reading_pays()
        if pays != self._reading:
            self._reading = pays
            log.info(
                "disk_tier.reading_on" if pays else "disk_tier.reading_off",
                read_ms_per_block=round(self.read_s_per_block * 1e3, 3),
                recompute_ms_per_block=round((self.recompute_s_per_block or 0.0) * 1e3, 3),
            )
        if pays:
            return True
        self._refusals = (self._refusals + 1) % _RETRY_EVERY
        return self._refusals == 0

    def _reading_pays(self) -> bool:
        return self.recompute_s_per_block is None or self.read_s_per_block < self.recompute_s_per_block

    def fetch(self, key: BlockKey) -> bytes | None:
        if not self.contains(key):
            return None
        with self._lock:
            payload = self._pending.get(key.block_hash)
            staged = self._unstage(key.block_hash) if payload is None else None
        if payload is None:
            payload = self._read(key, staged)
            if payload is None:
                self._forget(key.block_hash)
                return None
        self._entries.move_to_end(key.block_hash)
        self.hit_blocks += 1
        return payload

    def read_ahead(self, keys: list[BlockKey]) -> bool:
        """Hands the blocks of `keys` (a chain, in order) that are neither in memory nor being read to the
        reader thread; True while any of them is still being read (admission then waits a step). Nothing
        is read ahead while reading loses to recomputing, nor a chain too long to hold in memory."""
        if not self._reading_pays() or len(keys) * self.block_bytes > _MAX_STAGED_BYTES // 2:
            return False
        busy = False
        with self._lock:
            for key in keys:
                h = key.block_hash
                if h in self._in_flight:
                    busy = True
                elif h not in self._staged and h not in self._pending and self.contains(key):
                    self._in_flight.add(h)
                    self._reads.put(key)
                    busy = True
        return busy

    def wait_read_ahead(self) -> None:
        """Waits until the reader has read every block handed to it (tests)."""
        self._reads.join()

    def put(self, key: BlockKey, payload: bytes) -> None:
        if self.contains(key):
            self._entries.move_to_end(key.block_hash)
            return
        size = _HEADER.size + 8 * len(key.token_ids) + len(payload)
        if size > self.capacity_bytes or self._pending_bytes + len(payload) > _MAX_PENDING_BYTES:
            self.dropped_spills += 1
            return
        self._admit(key, size)
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

    def close(self, timeout_s: float | None = None) -> None:
        """Finishes the handed-over writes and stops the writer; after `timeout_s` the writes left are
        abandoned (a daemon thread: a file cut short is a `.tmp` the next start deletes). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._reads.put(None)
        self._jobs.put(None)
        self._writer.join(timeout_s)
        if self._writer.is_alive():
            log.warning("disk_tier.close_timed_out", unwritten_blocks=len(self._pending))

    # ---- shutdown -------------------------------------------------------------------------------

    def persist(
        self,
        blocks: list[CachedBlock],
        read: ReadBlocks,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> Persisted:
        """Keeps `blocks` (most valuable first, each content once) on disk: the longest head of the list the
        bound holds (evicting older files), blocks already here kept, the others read `_PERSIST_BATCH` at a
        time and written on this thread until `timeout_s` has passed; then ranks the kept ones most recent,
        in list order. Writes handed over before wait for the writer first, within the same time bound."""
        began = clock()
        if self._closed:
            return Persisted(len(blocks), 0, 0, 0, len(blocks), 0.0)
        deadline = began + timeout_s
        self._flush_until(deadline, clock)
        chosen = self._fitting(blocks)
        here = [b.key for b in chosen if self.contains(b.key)]
        for key in here:  # out of the eviction's way while the new ones are written
            self._entries.move_to_end(key.block_hash)
        new = [b for b in chosen if not self.contains(b.key)]
        written = self._write_until(new, read, deadline, clock)
        on_disk = [b.key for b in chosen if self.contains(b.key)]
        self._rank(on_disk)
        done = Persisted(
            len(blocks), len(here), written, len(blocks) - len(chosen), len(chosen) - len(on_disk), clock() - began
        )
        log.info("disk_tier.persisted", **asdict(done))
        return done

    def _flush_until(self, deadline: float, clock: Callable[[], float]) -> None:
        """`flush`, waiting no later than `deadline`."""
        done = self._jobs.all_tasks_done
        with done:
            while self._jobs.unfinished_tasks and (left := deadline - clock()) > 0:
                done.wait(left)

    def _fitting(self, blocks: list[CachedBlock]) -> list[CachedBlock]:
        """The longest head of `blocks` whose files the bound holds together."""
        room = self.capacity_bytes
        for i, block in enumerate(blocks):
            room -= self._file_size(block.key)
            if room < 0:
                return blocks[:i]
        return blocks

    def _write_until(
        self, blocks: list[CachedBlock], read: ReadBlocks, deadline: float, clock: Callable[[], float]
    ) -> int:
        """Reads and writes `blocks` in order, batch by batch, until `deadline`; how many were written."""
        written = 0
        for start in range(0, len(blocks), _PERSIST_BATCH):
            if clock() >= deadline:
                break
            batch = blocks[start : start + _PERSIST_BATCH]
            for block, payload in zip(batch, read(batch), strict=True):
                if clock() >= deadline or not self._write_now(block.key, payload):
                    return written
                written += 1
        return written

    def _write_now(self, key: BlockKey, payload: bytes) -> bool:
        """Indexes and writes one block on this thread; False (and forgotten) when the write failed."""
        self._admit(key, self._file_size(key))
        try:
            self.bytes_written += self._write_file(self._path(key.block_hash), key, payload)
        except OSError as exc:
            log.warning("disk_tier.io_failed", op="persist", path=str(self._path(key.block_hash)), error=str(exc))
            self._forget(key.block_hash)
            return False
        return True

    def _rank(self, keys: list[BlockKey]) -> None:
        """`keys` (most valuable first) become the most recently used, in that order, here and in the files'
        modification times the next start indexes by."""
        now = time.time_ns()
        for i, key in enumerate(reversed(keys)):
            self._entries.move_to_end(key.block_hash)
            stamp = now - (len(keys) - 1 - i) * _RANK_STEP_NS
            try:
                os.utime(self._path(key.block_hash), ns=(stamp, stamp))
            except OSError:
                pass  # (not written yet: the writer's late write is stamped newer still)

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

    def _file_size(self, key: BlockKey) -> int:
        return _HEADER.size + 8 * len(key.token_ids) + self.block_bytes

    def _admit(self, key: BlockKey, size: int) -> None:
        """Indexes `key` as most recently used, evicting the least recently used files beyond the bound."""
        self._forget(key.block_hash)  # a colliding hash with other content: the newer content wins
        self._make_room(size)
        self._entries[key.block_hash] = _Entry(key, size)
        self._used_bytes += size

    def _make_room(self, size: int) -> None:
        """Evicts until `size` more bytes fit the bound: other layouts' files first, oldest first, then this
        layout's least recently used."""
        while self._others and self._used_bytes + self._others_bytes + size > self.capacity_bytes:
            path, other_size = self._others.popleft()
            self._others_bytes -= other_size
            self._jobs.put(("unlink", 0, path))
        while self._entries and self._used_bytes + size > self.capacity_bytes:
            self._forget(next(iter(self._entries)))

    def _scan_others(self) -> None:
        """Lists the files of other layouts under the same directory (oldest first, counted toward the bound)
        and evicts those beyond it now, with a log line. (Their directories stay: another server may use one.)"""
        others: list[tuple[float, Path, int]] = []
        for folder in self.directory.parent.iterdir():
            if folder == self.directory or not folder.is_dir():
                continue
            others.extend((p.stat().st_mtime, p, p.stat().st_size) for p in folder.glob("*.kv"))
        others.sort()
        self._others.extend((path, size) for _, path, size in others)
        self._others_bytes = sum(size for _, _, size in others)
        self._make_room(0)
        if others:
            log.info(
                "disk_tier.other_layouts",
                files=len(others),
                evicted=len(others) - len(self._others),
                kept_gib=round(self._others_bytes / 2**30, 3),
            )

    def _forget(self, block_hash: int) -> None:
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return
        self._used_bytes -= entry.size
        with self._lock:
            payload = self._pending.pop(block_hash, None)
            if payload is not None:
                self._pending_bytes -= len(payload)
            self._in_flight.discard(block_hash)  # (a read in flight is then not staged)
            self._unstage(block_hash)
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

    def _read(self, key: BlockKey, staged: _Staged | None = None) -> bytes | None:
        """The block's payload, checked: read ahead (`staged`) or from its file now; the read's time weighed
        into the read estimate. None (the file skipped with a log line) when it is not the block whole."""
        if staged is None or staged.key != key:
            staged = self._staged_read(key)
        if staged.payload is None:
            self._skip(self._path(key.block_hash), staged.why)
            return None
        self.read_s_per_block += _EMA * (staged.seconds - self.read_s_per_block)
        self.bytes_read += self._file_size(key)
        return staged.payload

    def _staged_read(self, key: BlockKey) -> _Staged:
        """Reads and checks `key`'s file, timed (either thread: it touches no state)."""
        began = _timer()
        payload, why = self._verified(self._path(key.block_hash), key)
        return _Staged(key, payload, why, _timer() - began)

    def _unstage(self, block_hash: int) -> _Staged | None:
        """Takes a block's read-ahead result out of memory (under the lock)."""
        staged = self._staged.pop(block_hash, None)
        if staged is not None and staged.payload is not None:
            self._staged_bytes -= len(staged.payload)
        return staged

    def _read_loop(self) -> None:
        """The reader thread: reads what `read_ahead` handed over; a result is kept only while still wanted
        (an evicted block's read is dropped), the oldest results dropped beyond `_MAX_STAGED_BYTES`."""
        while (key := self._reads.get()) is not None:
            try:
                staged = self._staged_read(key)
                with self._lock:
                    if key.block_hash in self._in_flight:
                        self._in_flight.discard(key.block_hash)
                        self._stage(staged)
            finally:
                self._reads.task_done()
        self._reads.task_done()

    def _stage(self, staged: _Staged) -> None:
        """Keeps a read-ahead result (under the lock), dropping the oldest beyond the bound."""
        size = len(staged.payload or b"")
        while self._staged and self._staged_bytes + size > _MAX_STAGED_BYTES:
            self._unstage(next(iter(self._staged)))
        self._staged[staged.key.block_hash] = staged
        self._staged_bytes += size

    def _verified(self, path: Path, key: BlockKey) -> tuple[bytes | None, str]:
        """The payload of `path` if it is `key`'s block whole and unaltered (header and checksum), else None
        and why. Touches no state: the reader thread calls it too."""
        try:
            data = path.read_bytes()
        except OSError as exc:
            return None, f"unreadable: {exc}"
        head_size = _HEADER.size + 8 * len(key.token_ids)
        if len(data) != head_size + self.block_bytes:
            return None, f"truncated ({len(data)} bytes, {head_size + self.block_bytes} expected)"
        magic, digest, block_hash, parent, checksum, num_tokens, _ = _HEADER.unpack_from(data)
        payload = data[head_size:]
        stored = BlockKey(block_hash, parent, tuple(array("q", data[_HEADER.size : head_size])))
        if (magic, digest, num_tokens) != (MAGIC, self.digest, len(key.token_ids)) or stored != key:
            return None, "header does not match the index"
        if xxhash.xxh64_intdigest(payload) != checksum:
            return None, "payload checksum mismatch (tampered or corrupt)"
        return payload, ""

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
        if op == "unlink":  # another layout's file
            path.unlink(missing_ok=True)
            return
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
        self.bytes_written += self._write_file(path, entry.key, payload)
        with self._lock:
            if self._pending.get(block_hash) is payload:
                del self._pending[block_hash]
                self._pending_bytes -= len(payload)

    def _write_file(self, path: Path, key: BlockKey, payload: bytes) -> int:
        """Writes the block's file (atomically: a `.tmp` renamed); the bytes written."""
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
        return len(header) + 8 * len(key.token_ids) + len(payload)

    def _probe_read(self) -> float:
        """Seconds to read and check one block here as a restore does: a chain of `_PROBE_CHAIN` scratch
        blocks in this tier's format, read through the same checks, each payload held until the chain is
        read (a restore holds its chain until the step writes it into the pool, so every payload is fresh
        memory). The fastest of `_PROBES` chains, per block: another process's burst only ever adds time.
        Re-reading one file and dropping its bytes, as this probe did before, said 0.6 ms for a 3B model's
        block (1.75 MiB) on the 2-core box, where fetching a chain of them took 4-6 ms a block (this probe:
        3-5 ms); on the H200 it said 0.3-0.4 ms, and the first reads measured after it (a restarted engine's
        warm-up) came out above the 0.69 ms recompute estimate and shut the tier."""
        keys = [BlockKey(i, 0, tuple(range(_PROBE_TOKENS))) for i in range(_PROBE_CHAIN)]
        paths = [self.directory / f"read-probe-{i}.tmp" for i in range(_PROBE_CHAIN)]
        scratch = os.urandom(self.block_bytes)
        for path, key in zip(paths, keys, strict=True):
            self._write_file(path, key, scratch)
        fastest = float("inf")
        for _ in range(_PROBES):
            began = _timer()
            held = [self._verified(path, key) for path, key in zip(paths, keys, strict=True)]
            fastest = min(fastest, (_timer() - began) / len(held))
            del held
        for path in paths:
            path.unlink(missing_ok=True)
        return fastest
