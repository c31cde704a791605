"""ServiceError: a request the server refuses, with its wire code, HTTP status and OpenAI error type.

One vocabulary for both faces: the WebSocket sends `{"type":"error","error":{"code","message"}}`,
every HTTP error (a route's refusal, an unknown route, a wrong method, a guard's 413/415, a 500) is
`{"error":{"message","type","param","code"}}` with its status (`error_response`; `HTTP_CODES` names the
statuses that Starlette or a guard raise as `HTTPException`); an overload 503 also says `Retry-After`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from starlette.responses import JSONResponse

# code -> (HTTP status, OpenAI error type)
_KINDS: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "invalid_json": (400, "invalid_request_error"),
    "invalid_host": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "kv_cache_capacity_exceeded": (400, "invalid_request_error"),
    "duplicate_id": (400, "invalid_request_error"),
    "unknown_id": (400, "invalid_request_error"),
    "unknown_type": (400, "invalid_request_error"),
    "unsupported": (400, "invalid_request_error"),
    "previous_response_not_found": (400, "invalid_request_error"),
    "invalid_resume_token": (400, "invalid_request_error"),
    "resume_expired": (400, "invalid_request_error"),
    "resume_retention_exceeded": (400, "invalid_request_error"),
    "resume_forbidden": (403, "permission_error"),
    "unauthorized": (401, "authentication_error"),
    "forbidden_origin": (403, "permission_error"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_timeout": (408, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "unsupported_media_type": (415, "invalid_request_error"),
    "unprocessable_entity": (422, "invalid_request_error"),
    "too_many_requests": (429, "rate_limit_error"),
    "overloaded": (503, "server_error"),
    "shutting_down": (503, "server_error"),
    "engine_unavailable": (503, "server_error"),
    "internal_error": (500, "server_error"),
    "service_unavailable": (503, "server_error"),
}

# The 503s a retry may pass, and the seconds their Retry-After asks a client to wait (a dead engine's
# engine_unavailable is no such 503: a retry of the same server fails the same way).
RETRY_LATER = frozenset({"overloaded", "shutting_down", "service_unavailable"})
RETRY_AFTER_S = 1

# An HTTPException's status -> the code of its error body (other statuses: "http_error").
HTTP_CODES: dict[int, str] = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
    422: "unprocessable_entity",
    429: "too_many_requests",
    500: "internal_error",
    503: "service_unavailable",
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


def error_response(
    error: ServiceError, status: int | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """The HTTP answer to a refusal: its OpenAI error body, with its status (or `status`); a refusal that a
    later try may pass (`RETRY_LATER`: overloaded, warming up, draining) says when in `Retry-After`, which
    the OpenAI SDKs honour."""
    if error.code in RETRY_LATER:
        headers = {"Retry-After": str(RETRY_AFTER_S), **(headers or {})}
    return JSONResponse(error.openai_body(), status_code=status or error.status, headers=headers)


def queue_timed_out() -> ServiceError:
    """A request that timed out before it was ever scheduled (`RequestAccount.overloaded`), on every route."""
    return ServiceError(
        "overloaded", "the request waited longer than server.max_queue_time_s to be scheduled; retry later"
    )


def http_error(status: int, message: str) -> ServiceError:
    """The ServiceError for an HTTP status raised without one (Starlette's 404/405, a guard's 413/415)."""
    return ServiceError(HTTP_CODES.get(status, "http_error"), message)
