"""JSON for everything the server reads (WebSocket frames, HTTP bodies) and writes (frames, SSE chunks).

`loads` refuses, with a message naming the problem, text that cannot be encoded as UTF-8 (a lone UTF-16
surrogate such as `\\ud800`, legal in JSON) and nesting deeper than orjson's limit (1024), so no such value
ever reaches the tokenizer or a writer. It reads what Python's `json` writes for non-finite floats
(`NaN`, `Infinity`, `-Infinity`, and numbers beyond a double): not JSON, but what every Python client
sends for `float("inf")`. Refusing the whole frame would leave its id unreadable, so the client would get
an error it cannot match to its request; read, the frame keeps its id and the value meets its field's own
check, which names the field (no field accepts a non-finite number).

orjson parses and encodes these small objects about 15x faster than the standard library; the standard
library only sees what orjson refused. Text that orjson cannot encode (lone surrogates) falls back to the
standard library with every non-ASCII character escaped, so any value the server holds can be written.
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
    except (RecursionError, UnicodeEncodeError):
        raise _unencodable(what) from None
    if "surrogate" in reason or "UTF-8" in reason:
        raise _unencodable(what)
    if "depth" in reason or "recursion" in reason:
        raise _too_deep(what)
    return _with_non_finite(data, what, reason)


def loads_object(data: str | bytes, what: str, code: str = "invalid_request") -> dict[str, Any]:
    """`loads` for what must be a JSON object (a request body, a frame, an event); refused with `code`
    when it is other JSON."""
    value = loads(data, what)
    if not isinstance(value, dict):
        raise ServiceError(code, f"{what} must be a JSON object")
    return value


def _with_non_finite(data: str | bytes, what: str, reason: str) -> Any:
    """What orjson refused, read by the standard library (which also takes NaN, Infinity and numbers
    beyond a double); still refuses anything else orjson would have refused, with orjson's reason."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise _too_deep(what) from None
    except ValueError:  # not JSON at all (also: bytes that are not UTF-8, integers over 4300 digits)
        raise ServiceError("invalid_json", f"{what} is not valid JSON ({reason})") from None
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise _unencodable(what) from None
    except RecursionError:
        raise _too_deep(what) from None
    return value


def _unencodable(what: str) -> ServiceError:
    return ServiceError(
        "invalid_json",
        f"{what} contains text that cannot be encoded as UTF-8 (a lone UTF-16 surrogate such as \\ud800)",
    )


def _too_deep(what: str) -> ServiceError:
    return ServiceError("invalid_json", f"{what} is nested too deeply (at most 1024 levels of arrays and objects)")
