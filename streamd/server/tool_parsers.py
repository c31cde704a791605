"""Tool calls in a model's reply text -> OpenAI `tool_calls`, as the text streams.

Two formats, chosen from the model's chat template (`tool_format`):
- "hermes": `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call, after
  optional text (NousResearch Hermes 2/3, Qwen2.5, Qwen3 and the templates that copied them);
- "json": the reply is the call itself, `{"name": ..., "parameters": {...}}` (Llama 3.1 / 3.2 / 3.3, whose
  `<|python_tag|>` is a special token the detokenizer already dropped), several separated by ";".
  A grammar-enforced reply (`tool_choice` "required" or a named function: `{"name", "arguments"}`) is read
  with the same parser.
A template that defines neither (SmolLM2's, for one) gets no parser: `tool_choice="auto"` replies are text.

`ToolCallParser.feed(piece)` returns what is new since the last call: content text the client may show and
OpenAI tool-call deltas (the first of each call carries its id and name, later ones pieces of its JSON
`arguments`, in the model's own spelling). Text that could still turn out to be (part of) a call is held back
until it is decided; `feed("", final=True)` at the end releases it, after which `result()` and `called` tell
the whole reply. Parsing is incremental: each character is scanned once (a "json" reply is decided to be text or
calls from its first non-space characters; the JSON object scanner and the Hermes tag search go on from where
they stopped), and only a finished reply's calls are parsed whole.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_JSON_CALL_START = '{"name":'  # what a "json" reply starts with (whitespace removed) when it is a call
_SPACE = re.compile(r"\s+")
_NEXT_CALL = re.compile(r"[^\s;]")  # a "json" reply's next call starts after whitespace and ";"
_STRUCTURE = re.compile(r'["{}\[\]]')  # what the object scanner looks at outside strings
_IN_STRING = re.compile(r'["\\]')  # and inside them


def tool_format(chat_template: Any) -> str | None:
    """The tool-call format a chat template teaches its model: "hermes", "json" or None."""
    if not isinstance(chat_template, str):
        return None
    if _HERMES_OPEN in chat_template:
        return "hermes"
    if '"parameters": dictionary of argument name and its value' in chat_template:
        return "json"
    return None


@dataclass(slots=True)
class ToolDeltas:
    content: str
    tool_calls: list[dict[str, Any]]


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[dict[str, Any]]


@dataclass(slots=True)
class _Span:
    """One call's text in the reply (a "json" reply's object, a Hermes block's body) and what it told so far."""

    start: int
    end: int = -1  # where it ends once closed (-1: still open)
    name: str | None = None  # from its head, or (a closed call in another key order) from the whole call
    args: int = -1  # where its arguments text begins, once its head is read
    whole: str | None = None  # the arguments of a closed call in another key order (sent whole)
    read: bool = False  # closed and parsed whole (it had no head)


class _HermesReader:
    """Finds `<tool_call>` blocks, searching each tag from where the previous search left off."""

    def __init__(self) -> None:
        self.spans: list[_Span] = []
        self.first = -1  # where the first block opens (the content ends there)
        self.search = 0  # where the next tag search starts

    def read(self, text: str, final: bool) -> int:
        """Takes in the reply so far; returns how much of it is certainly content."""
        while True:
            span = self.spans[-1] if self.spans and self.spans[-1].end < 0 else None
            tag = _HERMES_OPEN if span is None else _HERMES_CLOSE
            at = text.find(tag, self.search)
            if at < 0:
                self.search = max(self.search, len(text) - len(tag) + 1)
                break
            if span is not None:
                span.end = at
            else:
                self.first = at if self.first < 0 else self.first
                self.spans.append(_Span(at + len(tag)))
            self.search = at + len(tag)
        if self.first >= 0:
            return self.first
        return len(text) if final else len(text) - _partial_tag(text, _HERMES_OPEN)

    def open_end(self, text: str, final: bool) -> int:
        """Where the open block's body ends so far (a partial closing tag is held back)."""
        return len(text) if final else len(text) - _partial_tag(text, _HERMES_CLOSE)


class _JsonReader:
    """Decides from the first non-space characters whether a reply is calls; then finds its JSON objects, each
    character scanned once (the scanner's position, depth and string state kept between pieces)."""

    def __init__(self) -> None:
        self.spans: list[_Span] = []
        self.calls: bool | None = None  # whether the reply is calls (None: undecided)
        self.head = ""  # the reply's first non-space characters, while undecided
        self.pos = 0  # where reading goes on
        self.depth, self.in_string, self.escaped = 0, False, False

    def read(self, text: str, final: bool) -> int:
        """Takes in the reply so far; returns how much of it is certainly content."""
        if self.calls is None:
            self.head = (self.head + _SPACE.sub("", text[self.pos :]))[: len(_JSON_CALL_START)]
            self.pos = len(text)
            if not _JSON_CALL_START.startswith(self.head):
                self.calls = False
            elif len(self.head) < len(_JSON_CALL_START):
                return len(text) if final else 0  # still undecided (empty, "{", '{"na', ...)
            else:
                self.calls, self.pos = True, 0
        if not self.calls:
            return len(text)
        self._scan(text)
        return 0

    def open_end(self, text: str, final: bool) -> int:
        return len(text)

    def _scan(self, text: str) -> None:
        while self.pos < len(text):
            if not self.spans or self.spans[-1].end >= 0:  # between calls
                found = _NEXT_CALL.search(text, self.pos)
                self.pos = len(text) if found is None else found.start()
                if found is not None:
                    self.spans.append(_Span(self.pos))
                continue
            if self.escaped:
                self.escaped, self.pos = False, self.pos + 1
                continue
            found = (_IN_STRING if self.in_string else _STRUCTURE).search(text, self.pos)
            if found is None:
                self.pos = len(text)
                break
            c, self.pos = found.group(), found.end()
            if self.in_string:
                if c == "\\":
                    self.escaped = True
                else:
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    self.spans[-1].end = self.pos


@dataclass(slots=True)
class ToolCallParser:
    format: str  # "hermes" or "json"
    text: str = ""
    _reader: _HermesReader | _JsonReader = field(init=False)
    _content: int = 0  # characters of content already sent
    _sent: list[int] = field(default_factory=list)  # per call whose name was sent: argument characters sent
    _final_content: int = -1  # at the end: how much of the reply is content
    _valid: list[_Span] | None = None  # at the end, once asked: the complete, valid calls

    def __post_init__(self) -> None:
        self._reader = _HermesReader() if self.format == "hermes" else _JsonReader()

    def feed(self, piece: str, final: bool = False) -> ToolDeltas:
        self.text += piece
        content = self._reader.read(self.text, final)
        spans = self._reader.spans
        if final:
            for span in spans:
                self._look(span, self._end(span, final), closed=True)
            if not any(span.name is not None for span in spans):  # e.g. a Llama reply that is JSON, not a call
                content, spans = len(self.text), []
            self._final_content = content
        new_content, self._content = self.text[self._content : content], max(self._content, content)
        deltas: list[dict[str, Any]] = []
        for i in range(max(len(self._sent) - 1, 0), len(spans)):
            span = spans[i]
            end = self._end(span, final)
            self._look(span, end, closed=span.end >= 0 or final)
            if i == len(self._sent):
                if span.name is None:
                    break
                self._sent.append(0)
                deltas.append(
                    {"index": i, "id": _call_id(), "type": "function", "function": {"name": span.name, "arguments": ""}}
                )
            arguments = self._arguments(span, end, self._sent[i])
            if arguments:
                deltas.append({"index": i, "function": {"arguments": arguments}})
                self._sent[i] += len(arguments)
        return ToolDeltas(new_content, deltas)

    def result(self) -> ParsedReply:
        """The whole reply (after `feed(..., final=True)`): its content (None when empty) and its complete,
        valid calls. A reply with no valid call is all content."""
        calls = [
            {
                "id": _call_id(),
                "type": "function",
                "function": {"name": span.name, "arguments": self._arguments(span, self._end(span, True))},
            }
            for span in self._valid_calls()
        ]
        if not calls:
            return ParsedReply(self.text, [])
        content = self.text[: self._final_content]
        return ParsedReply(content if content.strip() else None, calls)

    @property
    def called(self) -> bool:
        """Whether the whole reply (after `feed(..., final=True)`) holds a complete, valid call (its finish
        reason is then "tool_calls")."""
        return bool(self._valid_calls())

    def _valid_calls(self) -> list[_Span]:
        assert self._final_content >= 0, "the reply is not finished: feed(..., final=True) first"
        if self._valid is None:
            self._valid = [
                span
                for span in self._reader.spans
                if span.whole is not None
                or (span.name is not None and _as_call(self.text[span.start : self._end(span, True)]) is not None)
            ]
        return self._valid

    def _end(self, span: _Span, final: bool) -> int:
        return span.end if span.end >= 0 else self._reader.open_end(self.text, final)

    def _look(self, span: _Span, end: int, closed: bool) -> None:
        """Reads what `text[span.start:end]` tells of its call: its head once there, else (closed) the whole
        call, which may have its keys in another order."""
        if span.args >= 0 or span.read:
            return
        head = _CALL_HEAD.match(self.text, span.start, end)
        name = _string(head.group(1)) if head is not None else None
        if head is not None and name is not None:
            span.name, span.args = name, head.end()
        elif closed:
            span.read = True
            call = _as_call(self.text[span.start : end])
            if call is not None:
                span.name, span.whole = call[0], json.dumps(call[1])

    def _arguments(self, span: _Span, end: int, skip: int = 0) -> str:
        """A named call's arguments text so far, less its first `skip` characters. They are streamed as the
        model spells them; the last character (possibly the call's own closing brace) is held back until the
        call is complete."""
        if span.whole is not None:
            return span.whole[skip:]
        text, start = self.text, span.args
        while start < end and text[start].isspace():  # (the head's trailing whitespace, still coming)
            start += 1
        span.args = start
        stop = end
        while stop > start and text[stop - 1].isspace():
            stop -= 1
        return text[start + skip : max(start, stop - 1)]


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _string(token: str) -> str | None:
    """A JSON string token's value (None for one with a bad escape)."""
    try:
        return json.loads(token)
    except json.JSONDecodeError:
        return None


def _as_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """A call's whole JSON text -> (name, arguments); None unless it is {"name": str, "arguments"|"parameters":
    object}."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    args = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(args, dict):
        return None
    return call["name"], args


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (held back)."""
    at = text.find(tag[0], max(len(text) - len(tag) + 1, 0))
    while at >= 0 and not tag.startswith(text[at:]):
        at = text.find(tag[0], at + 1)
    return 0 if at < 0 else len(text) - at
