"""JSON encoding for everything the server writes per token (WebSocket frames, SSE chunks).

orjson encodes these small objects about 15x faster than the standard library. Text that orjson refuses
(lone surrogates, which JSON allows but UTF-8 does not) falls back to the standard library with every
non-ASCII character escaped, so any value the server holds can be written.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(obj: Any) -> str:
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
