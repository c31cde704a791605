"""Errors the engine raises for bad requests; the server maps each to a protocol error code."""


class RequestError(ValueError):
    """A request that can never be served as given (bad field, too long, cannot fit). `code` is the wire code."""

    code = "invalid_request"


class ContextLengthError(RequestError):
    """The prompt (plus max_tokens) exceeds the model's context."""

    code = "context_length_exceeded"


class KVCacheCapacityError(RequestError):
    """The prompt needs more KV cache blocks than the pool can ever give it."""

    code = "kv_cache_capacity_exceeded"
