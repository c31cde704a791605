"""Chat messages -> prompt token ids through the model's own chat template (never one from a request), or
the operator's (`model.chat_template`, `streamd serve --chat-template`: a file, or the template itself)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamd.engine.errors import RequestError


@dataclass(slots=True, frozen=True)
class TemplateOptions:
    """How a conversation is rendered; the defaults are how every generation request's is."""

    add_generation_prompt: bool = True  # end with the template's opening of the assistant's turn
    continue_final_message: bool = False  # leave the last message open, for the model to continue
    add_special_tokens: bool = False  # also the tokenizer's own special tokens (e.g. BOS) around the text
    # Extra variables for the template (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`);
    # never one of `apply_chat_template`'s own arguments (a request could otherwise bring its own template).
    template_kwargs: dict[str, Any] = field(default_factory=dict)


DEFAULT_OPTIONS = TemplateOptions()


def chat_template_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    options: TemplateOptions = DEFAULT_OPTIONS,
) -> list[int]:
    """Validates `messages` and renders them (and `tools`, OpenAI function tools, which the template
    shows the model its own way) as `options` say; any failure is a RequestError."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; send a plain prompt")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise RequestError(f"messages[{i}] must be an object with string 'role' and 'content'")
    _check_template_kwargs(tokenizer, options.template_kwargs)
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            tokenize=not options.add_special_tokens,
            add_generation_prompt=options.add_generation_prompt,
            continue_final_message=options.continue_final_message,
            **options.template_kwargs,
        )
        if options.add_special_tokens:  # the rendered text, tokenized as a plain prompt is
            ids = tokenizer(ids, add_special_tokens=True).input_ids
    except Exception as exc:  # templates raise jinja errors (e.g. roles must alternate): the request's fault
        raise RequestError(f"the model's chat template rejected these messages: {exc}") from exc
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def read_chat_template(spec: str) -> str:
    """`model.chat_template` as vLLM reads `--chat-template`: a file's text, else the template itself when it
    looks like one (it has braces or lines); else the path that could not be read is named."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(c in spec for c in "{}\n"):
        return spec
    raise ValueError(f"model.chat_template {spec!r} is neither a readable file nor a Jinja template")


def _check_template_kwargs(tokenizer: Any, kwargs: dict[str, Any]) -> None:
    """Template variables must be names that are no argument of `apply_chat_template` (`chat_template`,
    `tokenize`, ...), so they reach only the template. (The signature is read only when there are some.)"""
    if not kwargs:
        return
    reserved = inspect.signature(tokenizer.apply_chat_template).parameters
    for name in kwargs:
        if not isinstance(name, str) or not name.isidentifier() or name in reserved:
            raise RequestError(
                f"chat_template_kwargs: {name!r} is not a template variable this server passes on",
                "chat_template_kwargs",
            )
