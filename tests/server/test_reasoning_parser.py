"""The `<think>` reasoning parser on replies split at every awkward place: inside a tag, between a tag and
the answer, one character at a time. Whatever the split, the reasoning and the content are the same as the
reply parsed whole."""

from __future__ import annotations

import pytest

from streamd.server.reasoning import ReasoningParser, starts_inside, think_tags
from tests.smollm2_tokenizer import smollm2_tokenizer

REPLIES = [
    # (reply, starts inside, reasoning, content)
    ("<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.", False, "\nLet me see: 2+2.\n", "It is 4."),
    ("Let me see.</think>The answer", True, "Let me see.", "The answer"),
    ("No reasoning at all", False, None, "No reasoning at all"),
    ("  <think>a < b and </thin k></think>x", False, "a < b and </thin k>", "x"),
    ("<think>cut off before the end</thi", False, "cut off before the end</thi", ""),
    ("<thin", False, None, "<thin"),
    ("</think>\n\nAll answer", True, "", "All answer"),
]


def _split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _run(pieces: list[str], inside: bool) -> tuple[str | None, str]:
    parser = ReasoningParser(inside)
    reasoning, content = "", ""
    for piece in pieces:
        out = parser.feed(piece)
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = parser.feed("", final=True)
    reasoning, content = reasoning + out.reasoning, content + out.content
    assert (parser.reasoning_text or "") == reasoning
    return parser.reasoning_text, content


@pytest.mark.parametrize("reply, inside, reasoning, content", REPLIES)
def test_every_split_parses_as_the_whole(reply: str, inside: bool, reasoning: str | None, content: str) -> None:
    assert _run([reply], inside) == (reasoning, content)
    assert _run(list(reply), inside) == (reasoning, content)  # one character at a time
    for cut in range(1, len(reply)):
        for second in range(cut + 1, min(len(reply), cut + 9)):
            assert _run(_split(reply, [cut, second]), inside) == (reasoning, content), (cut, second)


def test_nothing_that_could_be_a_tag_leaks_before_it_is_decided() -> None:
    parser = ReasoningParser(False)
    assert parser.feed("<thi").content == ""
    out = parser.feed("nk>abc</th")
    assert (out.reasoning, out.content) == ("abc", "")
    out = parser.feed("ink>  ok")
    assert (out.reasoning, out.content) == ("", "ok")


def test_the_prompt_tells_where_the_reply_starts() -> None:
    assert starts_inside("<|im_start|>assistant\n<think>\n")  # DeepSeek-R1: opened by the template
    assert not starts_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking false
    assert not starts_inside("<|im_start|>assistant\n")
    tokenizer = smollm2_tokenizer()
    assert think_tags(tokenizer) is None  # SmolLM2's template does not reason
