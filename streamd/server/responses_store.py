"""Finished Responses kept so that `previous_response_id` can continue them: a bounded, in-memory LRU
with a TTL, partitioned by API key (one key never sees another key's responses), optionally shared with
other replicas through a directory (`server.responses_store_dir`).

A stored response keeps the conversation as chat messages (for the chat template) and the exact token
ids the engine saw and produced (prompt + output), so a continuation's prompt starts with those very ids
and the prefix cache covers the whole earlier conversation.

Replicas behind a router (`streamd cluster`) share one directory: every stored response is also written
there (one small JSON file, written to a temporary name and renamed, so a reader never sees half a file),
and a response this replica does not hold is read from it. So a follow-up finds its previous response
whichever replica the router picks, for HTTP and the WebSocket mode alike (a router cannot route those by
response id: the id travels in a JSON body or inside a WebSocket session). The directory keeps at most
`max_entries` files (the oldest go first) and files past their TTL are ignored and pruned. Without a
directory nothing survives a restart.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

_PRUNE_EVERY = 64  # puts between two prunings of the shared directory


@dataclass(slots=True, frozen=True)
class StoredResponse:
    id: str
    messages: list[dict[str, str]]  # the conversation so far, ending with the assistant's answer
    token_ids: list[int]  # prompt ids + output ids, exactly as the engine saw them


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float, directory: Path | None = None) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[str, str], tuple[float, StoredResponse]] = OrderedDict()
        self.shared = SharedResponses(directory, max_entries, ttl_s) if directory is not None else None

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, response: StoredResponse) -> None:
        self._remember(key, response, time.monotonic() + self.ttl_s)
        if self.shared is not None:
            self.shared.put(key, response)

    def get(self, key: str, response_id: str) -> StoredResponse | None:
        """The stored response, or None when unknown, expired or another key's."""
        entry = self._entries.get((key, response_id))
        if entry is None:
            return self._from_shared(key, response_id)
        expires, response = entry
        if time.monotonic() >= expires:
            del self._entries[(key, response_id)]
            return None
        self._entries.move_to_end((key, response_id))
        return response

    def _remember(self, key: str, response: StoredResponse, expires: float) -> None:
        self._entries[(key, response.id)] = (expires, response)
        self._entries.move_to_end((key, response.id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def _from_shared(self, key: str, response_id: str) -> StoredResponse | None:
        found = self.shared.get(key, response_id) if self.shared is not None else None
        if found is None:
            return None
        response, remaining_s = found
        self._remember(key, response, time.monotonic() + remaining_s)
        return response


class SharedResponses:
    """The directory replicas share: one file per stored response, named by a hash of the API key and the
    response id (an id alone never opens another key's response)."""

    def __init__(self, directory: Path, max_entries: int, ttl_s: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._puts = 0

    def put(self, key: str, response: StoredResponse) -> None:
        record = {"expires": time.time() + self.ttl_s, "response": asdict(response)}
        path = self._path(key, response.id)
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(json.dumps(record))
        temporary.replace(path)
        self._puts += 1
        if self._puts % _PRUNE_EVERY == 0:
            self.prune()

    def get(self, key: str, response_id: str) -> tuple[StoredResponse, float] | None:
        """The response and its remaining seconds, or None (unknown, expired, another key's)."""
        try:
            record = json.loads(self._path(key, response_id).read_text())
        except (FileNotFoundError, ValueError):
            return None
        remaining_s = float(record["expires"]) - time.time()
        if remaining_s <= 0:
            return None
        return StoredResponse(**record["response"]), remaining_s

    def prune(self) -> None:
        """Drops expired files and, beyond `max_entries`, the oldest."""
        now = time.time()
        files = sorted(self.directory.glob("*.json"), key=_mtime)
        excess = len(files) - self.max_entries
        for i, path in enumerate(files):
            if i < excess or _mtime(path) + self.ttl_s < now:
                path.unlink(missing_ok=True)

    def _path(self, key: str, response_id: str) -> Path:
        digest = hashlib.sha256(f"{key}\0{response_id}".encode()).hexdigest()[:32]
        return self.directory / f"{digest}.json"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0
