"""Checks of the request-body fields every OpenAI-style request shares (`model`, boolean flags, the chat
template's options).

Both wings read such bodies: the HTTP routes and the Responses API's WebSocket mode (whose `response.create`
carries the fields of `POST /v1/responses`). Their own module so that neither wing imports the other.
"""

from __future__ import annotations

from typing import Any

from streamd.engine import TemplateOptions
from streamd.logs import get_logger
from streamd.server.errors import ServiceError
from streamd.server.services import Services

logger = get_logger(__name__)
# Fields OpenAI SDKs and frontends send that this server ignores, counted under their own name; any other
# unknown name counts as "other" (a client cannot grow the metric's label set).
NAMED_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "modalities",
        "audio",
        "reasoning_effort",
        "web_search_options",
        "safety_identifier",
        "prompt_cache_key",
        "truncation",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "documents",
        "request_id",
    }
)


def body_flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A boolean field of a body (`default` when absent or null); anything else is refused, naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ServiceError("invalid_request", f"{name} must be a boolean, got {value!r}", name)
    return value


def check_model(s: Services, body: dict[str, Any]) -> None:
    """Refuses a `model` this server does not serve (absent: the one it serves)."""
    s.models.check(body.get("model"))


def template_options(body: dict[str, Any]) -> TemplateOptions:
    """vLLM's chat-template fields of a body: `add_generation_prompt`, `continue_final_message` (at most one
    of them true), `add_special_tokens` and `chat_template_kwargs` (an object of template variables)."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ServiceError("invalid_request", "chat_template_kwargs must be an object", "chat_template_kwargs")
    options = TemplateOptions(
        body_flag(body, "add_generation_prompt", True),
        body_flag(body, "continue_final_message", False),
        body_flag(body, "add_special_tokens", False),
        dict(kwargs or {}),
    )
    if options.add_generation_prompt and options.continue_final_message:
        raise ServiceError(
            "invalid_request",
            "add_generation_prompt and continue_final_message cannot both be true",
            "continue_final_message",
        )
    return options


def note_ignored(s: Services, route: str, body: dict[str, Any], known: frozenset[str]) -> None:
    """Logs (once, at debug) and counts the body's fields outside `known`, which this route ignores."""
    ignored = sorted(set(body) - known)
    if not ignored:
        return
    logger.debug("ignored_fields", route=route, fields=ignored[:32])
    for name in ignored:
        s.metrics.ignored_fields.labels(route, name if name in NAMED_IGNORED else "other").inc()
