"""Chat messages -> prompt token ids through the model's own chat template (never one from a request)."""

from __future__ import annotations

from typing import Any

from streamd.engine.errors import RequestError


def chat_template_ids(tokenizer: Any, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Validates `messages` and renders them (and `tools`, OpenAI function tools, which the template
    shows the model its own way) with the generation prompt; any failure is a RequestError."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; send a plain prompt")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise RequestError(f"messages[{i}] must be an object with string 'role' and 'content'")
    try:
        ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                            tokenize=True)
    except Exception as exc:  # templates raise jinja errors (e.g. roles must alternate): the request's fault
        raise RequestError(f"the model's chat template rejected these messages: {exc}") from exc
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
