"""Errors the engine raises for bad requests; the server maps each to a protocol error code."""

from __future__ import annotations


class RequestError(ValueError):
    """A request that can never be served as given (bad field, too long, cannot fit). `code` is the wire code;
    `param` names the request field at fault, when one is."""

    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """The prompt (plus max_tokens) exceeds the model's context."""

    code = "context_length_exceeded"


class KVCacheCapacityError(RequestError):
    """The prompt needs more KV cache blocks than the pool can ever give it."""

    code = "kv_cache_capacity_exceeded"
