"""Reasoning in a model's reply text (`<think>...</think>`, Qwen3 / QwQ / DeepSeek-R1) -> `reasoning_content`
apart from the answer, as the text streams.

The format is chosen from the model's chat template once (`think_tags`, as `tool_parsers.tool_format` chooses
the tool-call format): a template that mentions `<think>` teaches it. Where a reply starts is read from each
request's own prompt (`ThinkTags.starts_inside`): DeepSeek-R1's template opens `<think>` in the prompt, so
the reply begins inside the reasoning; Qwen3's with `enable_thinking` false opens and closes it there, so the
reply is all content.

`ReasoningParser.feed(piece)` returns what is new since the last call, as (reasoning, content): the text before
`</think>` (after an opening `<think>` at the reply's start, when the prompt did not open it) is reasoning,
the rest content (its leading whitespace after the closing tag dropped). A piece of a tag split across
deltas is held back until it is decided; `feed("", final=True)` releases it. Each character is scanned once.

`ReplyParser` is one choice's whole pipeline, as chat completions and the Responses API run it: the reasoning
parser (a reasoning model's), then the tool-call parser (`tool_parsers.py`, with a tool format) on the content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamd.server.tool_parsers import ToolCallParser

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


PROMPT_TAIL_TOKENS = 16  # the prompt's last tokens read for an open `<think>`


@dataclass(frozen=True, slots=True)
class ThinkTags:
    """A reasoning model's tags as its tokenizer spells them."""

    tokenizer: Any
    end_token_ids: list[int]  # `</think>`: what a thinking budget forces

    def starts_inside(self, prompt_ids: list[int]) -> bool:
        """Whether a reply to this prompt starts inside the reasoning (the prompt opened it)."""
        return starts_inside(self.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:]))


def think_tags(tokenizer: Any) -> ThinkTags | None:
    """The model's reasoning tags when its chat template teaches `<think>` (else None: replies are content)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or THINK_OPEN not in template:
        return None
    return ThinkTags(tokenizer, list(tokenizer(THINK_CLOSE, add_special_tokens=False).input_ids))


def starts_inside(prompt_tail: str) -> bool:
    """Whether a reply after this prompt text (its end suffices) starts inside the reasoning: the prompt's last
    `<think>` is not closed."""
    opened = prompt_tail.rfind(THINK_OPEN)
    return opened >= 0 and prompt_tail.rfind(THINK_CLOSE) < opened


@dataclass(slots=True)
class ReasoningDeltas:
    reasoning: str
    content: str


class ReasoningParser:
    """One choice's reply, split into reasoning and content as it streams."""

    def __init__(self, inside: bool) -> None:
        # "open": may still start with <think>; "inside": reasoning; "after": content, leading space dropped;
        # "content": content.
        self.state = "inside" if inside else "open"
        self.held = ""  # text not yet decided (a possible tag prefix, or space after the closing tag)
        self.reasoning: list[str] = []

    @property
    def reasoning_text(self) -> str | None:
        """The whole reasoning so far (None when the reply had none)."""
        return "".join(self.reasoning) if self.reasoning or self.state in ("inside", "after") else None

    def feed(self, piece: str, final: bool = False) -> ReasoningDeltas:
        text, self.held = self.held + piece, ""
        out = ReasoningDeltas("", "")
        while text:
            text = self._step(text, out, final)
        if final and self.held:
            self._emit(out, self.held, self.state == "inside")
            self.held = ""
        return out

    def _step(self, text: str, out: ReasoningDeltas, final: bool) -> str:
        """Consumes a prefix of `text` in the current state; returns the rest."""
        if self.state == "open":
            return self._opening(text, final)
        if self.state == "inside":
            return self._inside(text, out)
        if self.state == "after":
            stripped = text.lstrip()
            if stripped:
                self.state = "content"
            return stripped
        out.content += text
        return ""

    def _opening(self, text: str, final: bool) -> str:
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            self.state = "inside"
            return stripped[len(THINK_OPEN) :]
        if THINK_OPEN.startswith(stripped) and not final:
            self.held = text  # maybe the tag, still arriving
            return ""
        self.state = "content"
        return text

    def _inside(self, text: str, out: ReasoningDeltas) -> str:
        end = text.find(THINK_CLOSE)
        if end >= 0:
            self._emit(out, text[:end], True)
            self.state = "after"
            return text[end + len(THINK_CLOSE) :]
        keep = _partial_tag(text, THINK_CLOSE)
        self._emit(out, text[: len(text) - keep], True)
        self.held = text[len(text) - keep :]
        return ""

    def _emit(self, out: ReasoningDeltas, text: str, reasoning: bool) -> None:
        if reasoning:
            out.reasoning += text
            self.reasoning.append(text)
        else:
            out.content += text


@dataclass(slots=True)
class ReplyDeltas:
    reasoning: str
    content: str
    tool_calls: list[dict[str, Any]]  # OpenAI tool-call deltas (`ToolCallParser.feed`)


class ReplyParser:
    """One choice's reply as it streams -> what is new of its reasoning, content and tool calls. Without a
    reasoning model (`think_inside` None) and tools (`tool_format` None) the text is all content."""

    __slots__ = ("reasoner", "tools")

    def __init__(self, think_inside: bool | None, tool_format: str | None) -> None:
        self.reasoner = ReasoningParser(think_inside) if think_inside is not None else None
        self.tools = ToolCallParser(tool_format) if tool_format is not None else None

    def feed(self, piece: str, final: bool = False) -> ReplyDeltas:
        reasoning = ""
        if self.reasoner is not None:
            split = self.reasoner.feed(piece, final)
            reasoning, piece = split.reasoning, split.content
        if self.tools is None:
            return ReplyDeltas(reasoning, piece, [])
        out = self.tools.feed(piece, final)
        return ReplyDeltas(reasoning, out.content, out.tool_calls)

    @property
    def called(self) -> bool:
        """Whether the whole reply (after `feed(..., final=True)`) made a complete, valid tool call."""
        return self.tools is not None and self.tools.called


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
