"""The response store shared by replicas through a directory: a response one replica stored is found by
another (each its own `ResponseStore`, as in two processes), never under another API key, not after its TTL,
and the directory keeps at most `max_entries` files."""

from __future__ import annotations

import os
import time
from pathlib import Path

from streamd.server.responses_store import ResponseStore, StoredResponse


def _response(i: int) -> StoredResponse:
    return StoredResponse(f"resp_{i}", [{"role": "user", "content": f"w{i}"}], [i, i + 1, i + 2])


def test_another_replica_finds_a_stored_response(tmp_path: Path) -> None:
    first, second = ResponseStore(8, 60.0, tmp_path), ResponseStore(8, 60.0, tmp_path)
    first.put("key-a", _response(1))
    assert second.get("key-a", "resp_1") == _response(1)
    assert second.get("key-b", "resp_1") is None  # another key's
    assert ResponseStore(8, 60.0).get("key-a", "resp_1") is None  # without the directory: this process only


def test_expired_and_excess_files_go(tmp_path: Path) -> None:
    store = ResponseStore(4, 60.0, tmp_path)
    for i in range(6):
        store.put("k", _response(i))
    old = time.time() - 3600
    for path in sorted(tmp_path.glob("*.json"))[:1]:
        os.utime(path, (old, old))
    assert store.shared is not None
    store.shared.prune()
    assert len(list(tmp_path.glob("*.json"))) == 4  # the aged file and the oldest other went
    assert ResponseStore(4, 60.0, tmp_path).get("k", "resp_5") == _response(5)  # the newest stayed
    aged = ResponseStore(8, 60.0, tmp_path / "aged")
    aged.put("k", _response(7))
    aged.put("k", _response(8))
    os.utime(aged.shared._path("k", "resp_7"), (old, old))
    aged.shared.prune()  # under max_entries: only the file past its TTL goes
    assert sorted(p.name for p in (tmp_path / "aged").glob("*.json")) == [aged.shared._path("k", "resp_8").name]
    short = ResponseStore(4, 0.05, tmp_path / "short")
    short.put("k", _response(9))
    deadline = time.monotonic() + 10
    while ResponseStore(4, 0.05, tmp_path / "short").get("k", "resp_9") is not None:  # expires by the clock
        assert time.monotonic() < deadline
        time.sleep(0.01)
