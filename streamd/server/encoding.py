"""JSON for everything the server reads (WebSocket frames, HTTP bodies) and writes (frames, SSE chunks).

`loads` refuses, with a message naming the problem, text that cannot be encoded as UTF-8 (a lone UTF-16
surrogate such as `\\ud800`, legal in JSON) and nesting deeper than orjson's limit (1024), so no such value
ever reaches the tokenizer or a writer.

orjson encodes these small objects about 15x faster than the standard library. Text that orjson refuses
(lone surrogates, which JSON allows but UTF-8 does not) falls back to the standard library with every
non-ASCII character escaped, so any value the server holds can be written.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from streamd.server.errors import ServiceError


def dumps(obj: Any) -> str:
    try:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"))


def loads(data: str | bytes, what: str) -> Any:
    """Parses JSON; raises ServiceError (code `invalid_json`) saying what was wrong with `what`."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
        if "surrogate" in reason or "UTF-8" in reason:
            message = (f"{what} contains text that cannot be encoded as UTF-8 (a lone UTF-16 surrogate such "
                       "as \\ud800)")
        elif "depth" in reason or "recursion" in reason:
            message = f"{what} is nested too deeply (at most 1024 levels of arrays and objects)"
        else:
            message = f"{what} is not valid JSON"
        raise ServiceError("invalid_json", message) from None
    except (RecursionError, UnicodeEncodeError):
        raise ServiceError("invalid_json", f"{what} contains text that cannot be encoded as UTF-8") from None
