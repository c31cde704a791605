"""Tool-call parsing of model replies (`tool_parsers.py`), on text: the format chosen from real chat
templates, whole replies and the same replies fed in every possible split into streamed pieces (the
streamed deltas must add up to exactly the whole reply's calls and content)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streamd.server.tool_parsers import ToolCallParser, tool_format
from tests.chat_templates import LLAMA_3_2_TEMPLATE, QWEN_2_5_TEMPLATE
from tests.smollm2_tokenizer import smollm2_tokenizer

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
HERMES_TWO = HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'


def test_format_is_chosen_from_the_chat_template() -> None:
    assert tool_format(QWEN_2_5_TEMPLATE) == "hermes"
    assert tool_format(LLAMA_3_2_TEMPLATE) == "json"
    assert tool_format(smollm2_tokenizer().chat_template) is None
    assert tool_format(None) is None


def _streamed(fmt: str, text: str, cuts: list[int]) -> tuple[str, list[dict[str, Any]]]:
    """Feeds `text` cut at `cuts`; returns the streamed content and the calls the deltas add up to."""
    parser = ToolCallParser(fmt)
    content, calls = "", []
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    for i, piece in enumerate(pieces):
        out = parser.feed(piece, final=i == len(pieces) - 1)
        content += out.content
        for delta in out.tool_calls:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["id"].startswith("call_")
                calls.append({"name": delta["function"]["name"], "arguments": ""})
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("fmt, text, content, calls", [
    ("hermes", HERMES_CALL, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("hermes", "Let me check." + HERMES_TWO, "Let me check.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]),
    ("hermes", "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.",
     []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("json", LLAMA_CALL, None, [("get_weather", {"city": "Paris", "unit": "celsius"})]),
    ("json", ' {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": [1, "}"]}}', None,
     [("a", {}), ("b", {"x": [1, "}"]})]),
    ("json", '{"city": "Paris"}', '{"city": "Paris"}', []),
    ("json", "Paris is sunny.", "Paris is sunny.", []),
    ("json", '{"name": "get_time", "arguments": {"zone": "UTC"}}', None, [("get_time", {"zone": "UTC"})]),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>', None, [("a", {"x": 1})]),
    # Not calls: arguments that are no object (in another key order, so nothing streams as a call first),
    # a name with a bad escape.
    ("hermes", '<tool_call>{"arguments": [1], "name": "a"}</tool_call>',
     '<tool_call>{"arguments": [1], "name": "a"}</tool_call>', []),
    ("hermes", '<tool_call>{"name": "a\\q", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "a\\q", "arguments": {}}</tool_call>', []),
    ("json", '{"name": "a\\q", "arguments": {}}', '{"name": "a\\q", "arguments": {}}', []),
])
def test_replies_parse_whole_and_in_every_split(fmt: str, text: str, content: str | None,
                                                calls: list[tuple[str, dict[str, Any]]]) -> None:
    parser = ToolCallParser(fmt)
    parser.feed(text, final=True)
    reply = parser.result()
    assert reply.content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply.tool_calls] == calls
    assert parser.called == bool(calls)
    for cut in range(1, len(text)):
        for cuts in ([cut], [cut, min(cut + 7, len(text))], list(range(cut, len(text), cut))):
            cuts = sorted(set(c for c in cuts if 0 < c < len(text)))
            streamed_content, streamed_calls = _streamed(fmt, text, cuts)
            assert streamed_content == (content or "") if calls else streamed_content == text, (cuts, streamed_content)
            assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls, cuts


@pytest.mark.parametrize("fmt, opening, closing, end", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": ', '}\n</tool', "_call>"),
    ("json", '{"name": "get_weather", "parameters": ', "}", ""),
])
def test_arguments_stream_in_pieces_before_the_call_closes(fmt: str, opening: str, closing: str, end: str) -> None:
    parser = ToolCallParser(fmt)
    first = parser.feed(opening + '{"city": "Pa')
    assert [d["function"].get("name") for d in first.tool_calls] == ["get_weather", None]
    assert first.tool_calls[-1]["function"]["arguments"] == '{"city": "P'  # the last character waits
    later = parser.feed('ris"}' + closing)
    assert "".join(d["function"]["arguments"] for d in later.tool_calls) == 'aris"}'
    assert not parser.feed(end, final=True).tool_calls and parser.called
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.result().tool_calls] == [
        ("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("fmt, text", [
    ("json", '{"name":"a","parameters":[1]}'),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": "x"}\n</tool_call>'),
])
def test_a_call_whose_arguments_are_no_object_is_content(fmt: str, text: str) -> None:
    """Its head may have streamed as a call's, but the finished reply holds no valid call: its content is the
    whole text and its finish reason is not "tool_calls"."""
    parser = ToolCallParser(fmt)
    parser.feed(text, final=True)
    reply = parser.result()
    assert reply.content == text and reply.tool_calls == [] and not parser.called
