"""ServiceError: a request the server refuses, with its wire code, HTTP status and OpenAI error type.

One vocabulary for both faces: the WebSocket sends `{"type":"error","error":{"code","message"}}`,
the OpenAI routes send `{"error":{"message","type","param","code"}}` with `status`.
"""

from __future__ import annotations

from dataclasses import dataclass

# code -> (HTTP status, OpenAI error type)
_KINDS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "kv_cache_capacity_exceeded": (400, "invalid_request_error"),
    "duplicate_id": (400, "invalid_request_error"),
    "unknown_id": (400, "invalid_request_error"),
    "unknown_type": (400, "invalid_request_error"),
    "unsupported": (400, "invalid_request_error"),
    "previous_response_not_found": (400, "invalid_request_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden_origin": (403, "permission_error"),
    "model_not_found": (404, "invalid_request_error"),
    "payload_too_large": (413, "invalid_request_error"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "too_many_requests": (429, "rate_limit_error"),
    "overloaded": (503, "server_error"),
    "shutting_down": (503, "server_error"),
    "engine_unavailable": (503, "server_error"),
    "internal_error": (500, "server_error"),
}


@dataclass(slots=True)
class ServiceError(Exception):
    code: str
    message: str
    param: str | None = None

    def __str__(self) -> str:
        return self.message

    @property
    def status(self) -> int:
        return _KINDS.get(self.code, (400, ""))[0]

    @property
    def type(self) -> str:
        return _KINDS.get(self.code, (400, "invalid_request_error"))[1]

    def wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}

    def openai_body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
