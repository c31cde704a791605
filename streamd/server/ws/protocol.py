"""The WebSocket protocol: parsing client frames, building server frames, encoding messages.

Client: `{"type":"generate","id":ID,"prompt":TEXT|"messages":[...],"params":{...}}` (with messages also
OpenAI function `tools` and `tool_choice`: the reply's calls then come as `tool_calls` on its delta frames),
`{"type":"cancel","id":ID}`, `{"type":"resume","id":ID,"resume_token":T,"after_seq":K}`,
`{"type":"ack","id":ID,"resume_token":T}` (its `done` arrived: nothing to keep for a resume). Server: `start`
(the `service_tier` served; with a `resume_token` when resumable), `delta` (seq from 0 per id), `done`
(finish_reason, usage; `drained: true` when the server's drain cut it) and `error` (id or null). Two framings
of the same frames, chosen by subprotocol:

- `streamd.v1` (also the default when none is offered): one frame per WebSocket message;
- `streamd.v2`: each message is a JSON array of frames: everything a connection has to send when the
  writer wakes (typically one engine step's deltas of all its requests) goes out in one message.

Pure functions, no I/O, so every rule is unit-testable. JSON goes through `encoding.dumps` (orjson).

The live engine view: `{"type":"subscribe_stats","interval_ms":MS}` and `{"type":"unsubscribe_stats"}` (no
id); while subscribed the server sends `stats` frames (built in stats_feed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamd.engine import Progress
from streamd.server.encoding import dumps, loads_object
from streamd.server.errors import ServiceError

SUBPROTOCOL_V1 = "streamd.v1"
SUBPROTOCOL_V2 = "streamd.v2"
SUBPROTOCOLS = (SUBPROTOCOL_V2, SUBPROTOCOL_V1)  # preference order when a client offers both
MAX_ID_LENGTH = 256
STATS_INTERVAL_MS = (100, 500, 10_000)  # subscribe_stats interval_ms: minimum, default, maximum
Frame = dict[str, Any]


@dataclass(slots=True)
class Generate:
    id: str
    prompt: str | list[int] | None = None
    messages: list[Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    tools: Any = None  # OpenAI function tools (with messages only)
    tool_choice: Any = None


@dataclass(slots=True)
class SubscribeStats:
    interval_s: float


@dataclass(slots=True)
class UnsubscribeStats:
    pass


def _stats_frame(frame: dict[str, Any]) -> SubscribeStats | UnsubscribeStats:
    allowed = {"type", "interval_ms"} if frame["type"] == "subscribe_stats" else {"type"}
    unknown = sorted(set(frame) - allowed)
    if unknown:
        raise ServiceError("invalid_request", f"unknown field {unknown[0]!r} in {frame['type']}")
    if frame["type"] == "unsubscribe_stats":
        return UnsubscribeStats()
    low, default, high = STATS_INTERVAL_MS
    interval = frame.get("interval_ms", default)
    if isinstance(interval, bool) or not isinstance(interval, int) or not low <= interval <= high:
        raise ServiceError("invalid_request", f"interval_ms must be an integer from {low} to {high}")
    return SubscribeStats(interval / 1000)


@dataclass(slots=True)
class Cancel:
    id: str


@dataclass(slots=True)
class Ack:
    """The client has a finished request's `done`: its output need not be kept for a resume."""

    id: str
    resume_token: Any  # checked by the resume store


@dataclass(slots=True)
class Resume:
    id: str
    resume_token: Any
    after_seq: Any  # checked against the request's frames (resume.py)


def parse_frame(text: str) -> Generate | Cancel | Resume | Ack | SubscribeStats | UnsubscribeStats:
    """Raises ServiceError (with `param` set to the frame's id when one could be read)."""
    frame = loads_object(text, "the frame", code="invalid_json")
    if frame.get("type") in ("subscribe_stats", "unsubscribe_stats"):
        return _stats_frame(frame)
    frame_id = check_id(frame.get("id"), "id", None)
    kind = frame.get("type")
    if kind == "cancel":
        return Cancel(frame_id)
    if kind == "resume":
        return Resume(frame_id, frame.get("resume_token"), frame.get("after_seq"))
    if kind == "ack":
        return Ack(frame_id, frame.get("resume_token"))
    if kind != "generate":
        raise ServiceError(
            "unknown_type",
            f"unknown frame type {kind!r}; expected generate, cancel, resume, ack, subscribe_stats or "
            "unsubscribe_stats",
            frame_id,
        )
    unknown = sorted(set(frame) - {"type", "id", "prompt", "messages", "params", "tools", "tool_choice"})
    if unknown:
        raise ServiceError("invalid_request", f"unknown field {unknown[0]!r}", frame_id)
    has_prompt, has_messages = frame.get("prompt") is not None, frame.get("messages") is not None
    if has_prompt == has_messages:
        raise ServiceError("invalid_request", "give exactly one of prompt or messages", frame_id)
    params = frame.get("params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise ServiceError("invalid_request", "params must be an object", frame_id)
    if not has_messages and (frame.get("tools") is not None or frame.get("tool_choice") is not None):
        raise ServiceError("invalid_request", "tools and tool_choice need messages", frame_id)
    return Generate(
        frame_id, frame.get("prompt"), frame.get("messages"), params, frame.get("tools"), frame.get("tool_choice")
    )


def check_id(value: Any, name: str, param: str | None) -> str:
    """A client-chosen id (a frame's `id`, a Responses lane's `stream_id`): a non-empty string of at most
    MAX_ID_LENGTH characters, echoed in every frame about it; raises ServiceError naming `name`."""
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise ServiceError(
            "invalid_request", f"{name} must be a non-empty string of at most {MAX_ID_LENGTH} characters", param
        )
    return value


def start_frame(
    request_id: str, prompt_tokens: int, resume_token: str | None = None, service_tier: str = "default"
) -> Frame:
    """The request was admitted: its prompt's length and the tier it is served in (OpenAI's `service_tier`)."""
    frame: Frame = {"type": "start", "id": request_id, "prompt_tokens": prompt_tokens, "service_tier": service_tier}
    if resume_token is not None:
        frame["resume_token"] = resume_token
    return frame


def progress_frame(request_id: str, prompt_tokens: int, progress: Progress) -> Frame:
    """Before the first token: the request's place in the queue (null once scheduled) and how much of its
    prompt the model has read (`prompt_tokens_done` of `prompt_tokens`, `cached_tokens` of them cached)."""
    return {
        "type": "progress",
        "id": request_id,
        "queue_position": progress.queue_position,
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_done": progress.prompt_tokens_done,
        "cached_tokens": progress.cached_tokens,
    }


def delta_frame(
    request_id: str,
    seq: int,
    text: str,
    token_ids: list[int],
    index: int,
    logprobs: list[dict[int, float]] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> Frame:
    """A choice's new tokens and text (with tools: its content, the calls' text withheld) and, with tools,
    OpenAI tool-call deltas (`tool_calls`: the first of a call with its id and name, then argument pieces)."""
    frame: Frame = {"type": "delta", "id": request_id, "seq": seq, "text": text, "token_ids": token_ids, "index": index}
    if logprobs is not None:
        frame["logprobs"] = logprobs  # the int token ids become string keys
    if tool_calls:
        frame["tool_calls"] = tool_calls
    return frame


def done_frame(
    request_id: str, finish_reason: str, usage: dict[str, Any], finish_reasons: list[str], drained: bool = False
) -> Frame:
    """`finish_reason` is the request's (its first choice's); `finish_reasons` has one per choice;
    `drained`: the server's drain deadline cancelled it (reconnect elsewhere and ask again)."""
    frame: Frame = {
        "type": "done",
        "id": request_id,
        "finish_reason": finish_reason,
        "finish_reasons": finish_reasons,
        "usage": usage,
    }
    if drained:
        frame["drained"] = True
    return frame


def error_frame(request_id: str | None, error: ServiceError) -> Frame:
    return {"type": "error", "id": request_id, "error": error.wire()}


def encode(frames: list[Frame], batched: bool) -> list[str]:
    """The messages that carry `frames`: one (a JSON array) when batched (v2), else one per frame (v1)."""
    if batched:
        return [dumps(frames)]
    return [dumps(frame) for frame in frames]
