"""Finished Responses kept so that `previous_response_id` can continue them: a bounded, in-memory LRU
with a TTL, partitioned by API key (one key never sees another key's responses).

A stored response keeps the conversation as chat messages (for the chat template) and the exact token
ids the engine saw and produced (prompt + output), so a continuation's prompt starts with those very ids
and the prefix cache covers the whole earlier conversation. Nothing survives a restart.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class StoredResponse:
    id: str
    messages: list[dict[str, str]]  # the conversation so far, ending with the assistant's answer
    token_ids: list[int]  # prompt ids + output ids, exactly as the engine saw them


class ResponseStore:
    def __init__(self, max_entries: int, ttl_s: float) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._entries: OrderedDict[tuple[str, str], tuple[float, StoredResponse]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: str, response: StoredResponse) -> None:
        self._entries[(key, response.id)] = (time.monotonic() + self.ttl_s, response)
        self._entries.move_to_end((key, response.id))
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key: str, response_id: str) -> StoredResponse | None:
        """The stored response, or None when unknown, expired or another key's."""
        entry = self._entries.get((key, response_id))
        if entry is None:
            return None
        expires, response = entry
        if time.monotonic() >= expires:
            del self._entries[(key, response_id)]
            return None
        self._entries.move_to_end((key, response_id))
        return response
