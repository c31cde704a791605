"""Both incremental detokenizers (the byte table and the windowed Rust decode) with the real SmolLM2 (GPT-2 style byte-level BPE) tokenizer: multi-byte characters
split across tokens never come out as U+FFFD or halves, text comes out as soon as it is complete, and the
increments add up to the tokenizer's own decode of the output tokens."""

from __future__ import annotations

import random

import pytest

from streamd.engine.output.detokenizer import ByteLevelDetokenizer, IncrementalDetokenizer, byte_table, make_detokenizer
from tests.smollm2_tokenizer import smollm2_tokenizer

FFFD = "\ufffd"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀😃 🎉🚀 family 👨‍👩‍👧‍👦 flag 🇫🇷🇯🇵 skin 👍🏽 done.",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트.",
    "Mixed: naïve café — “quotes” … ¿qué? Ελληνικά Кириллица 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√∞",
    "  leading spaces,\ttabs,\nnewlines\n\n and trailing   ",
    "🙂",
    # Spaces before punctuation survive (no clean-up pass rewriting text across token boundaries).
    "a , b . c ? d ! it 's do n't",
]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.fixture(params=["byte_table", "window"])
def detokenizer(request, tok):
    """A detokenizer factory: the byte-level one (SmolLM2's default) or the windowed one (other tokenizers)."""
    table = byte_table(tok) if request.param == "byte_table" else None
    assert request.param == "window" or table is not None
    return lambda prompt_ids, **kw: make_detokenizer(tok, table, prompt_ids, **kw)


def _feed(detokenizer, prompt_ids: list[int], out_ids: list[int], **kw):
    det = detokenizer(prompt_ids, **kw)
    return det, [det.update([t]) for t in out_ids]


def test_texts_split_across_tokens(tok, detokenizer) -> None:
    prompt = tok.encode("Say something:")
    for text in TEXTS:
        out = tok.encode(text)
        # The interesting inputs really do split characters over tokens.
        if any(ord(c) > 0x7FF for c in text):
            assert any(FFFD in tok.decode([t]) for t in out), text
        det, pieces = _feed(detokenizer, prompt, out)
        assert all(FFFD not in p for p in pieces), (text, pieces)
        assert "".join(pieces) + det.flush() == tok.decode(out) == text
        # Prompt: emitted as soon as it is complete, i.e. after every token where the decode of the
        # output so far is whole, everything so far has been emitted.
        for k in range(1, len(out) + 1):
            whole = tok.decode(out[:k])
            if not whole.endswith(FFFD):
                assert "".join(pieces[:k]) == whole, (text, k)


def test_each_piece_is_whole_characters(tok, detokenizer) -> None:
    out = tok.encode("".join(TEXTS))
    _, pieces = _feed(detokenizer, [], out)
    for piece in pieces:
        assert FFFD not in piece
        # A piece re-encodes to valid UTF-8 on its own (no lone surrogates / fragments).
        assert piece.encode("utf-8").decode("utf-8") == piece


def test_multi_token_updates(tok, detokenizer) -> None:
    text = "Chunks 🇫🇷 of 中文 and 👨‍👩‍👧 in varying sizes."
    prompt = tok.encode("Prompt")
    out = tok.encode(text)
    rng = random.Random(0)
    det = detokenizer(prompt)
    pieces, i = [], 0
    while i < len(out):
        k = rng.randint(1, 4)
        pieces.append(det.update(out[i:i + k]))
        i += k
    assert "".join(pieces) == text and all(FFFD not in p for p in pieces)


def test_context_from_prompt_keeps_leading_space(tok, detokenizer) -> None:
    prompt = tok.encode("Hello")
    out = tok.encode(" world, again")
    det, pieces = _feed(detokenizer, prompt, out)
    assert "".join(pieces) == " world, again"
    assert pieces[0] == " world"


def test_random_byte_soup_matches_decode(tok, detokenizer) -> None:
    """Random ids, many of them single-byte tokens that form invalid or partial UTF-8: the increments (plus
    the final flush) always equal decode(all), and pieces never end in the middle of a character."""
    rng = random.Random(1234)
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.convert_ids_to_tokens(i)) == 1][:256]
    for _ in range(30):
        prompt = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(0, 8))]
        out = [rng.choice(byte_tokens) if rng.random() < 0.7 else rng.randrange(3, tok.vocab_size)
               for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            det, pieces = _feed(detokenizer, prompt, out, skip_special_tokens=skip)
            assert all(not p.endswith(FFFD) for p in pieces)
            assert "".join(pieces) + det.flush() == tok.decode(out, skip_special_tokens=skip)


def test_flush_returns_held_incomplete_character(tok, detokenizer) -> None:
    out = tok.encode("ok 😀")
    det, pieces = _feed(detokenizer, [], out[:-1])  # the emoji's last byte never comes
    assert "".join(pieces) in ("ok", "ok ")  # the space may wait with the character's first bytes
    assert "".join(pieces) + det.flush() == "ok " + FFFD
    assert det.flush() == ""


def test_special_tokens_skipped_or_kept(tok, detokenizer) -> None:
    out = tok.encode("Hi") + [tok.eos_token_id]
    _, pieces = _feed(detokenizer, [], out)
    assert "".join(pieces) == "Hi"
    _, pieces = _feed(detokenizer, [], out, skip_special_tokens=False)
    assert "".join(pieces) == "Hi" + tok.eos_token


def test_prompt_ending_mid_character(tok, detokenizer) -> None:
    ids = tok.encode("abc 😀 done")
    # Find a cut inside the emoji: the prompt's decode ends in U+FFFD.
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith(FFFD))
    det, pieces = _feed(detokenizer, ids[:cut], ids[cut:])
    joined = "".join(pieces)
    assert FFFD not in joined
    assert joined.endswith("😀 done") and "😀" in joined


def test_window_stays_small(tok) -> None:
    """Cost per token is constant: the decoded window never grows with the output length."""
    out = tok.encode(" ".join(TEXTS) * 20)
    det = IncrementalDetokenizer(tok, tok.encode("prompt"))
    longest = 0
    for t in out:
        det.update([t])
        longest = max(longest, len(det._window))
    assert len(out) > 500 and longest <= 12


def test_long_run_of_skipped_special_tokens(tok) -> None:
    """ignore_eos can produce hundreds of EOS tokens: they add no text and do not grow the window."""
    out = tok.encode("Hi") + [tok.eos_token_id] * 300 + tok.encode(" there 🎉")
    det, pieces = _feed(lambda ids, **kw: IncrementalDetokenizer(tok, ids, **kw), [], out[:-3])
    assert len(det._window) <= 12
    pieces += [det.update([t]) for t in out[-3:]]
    assert "".join(pieces) == tok.decode(out, skip_special_tokens=True) == "Hi there 🎉"


def test_byte_table_is_the_tokenizers_decode(tok) -> None:
    """The table's bytes, joined and read as UTF-8, are the Rust decode of any id sequence (special tokens
    skipped or kept, ids past the vocabulary included), and the server's default detokenizer is this one."""
    table = byte_table(tok)
    assert table is not None and byte_table(tok) is table  # built once per tokenizer
    assert isinstance(make_detokenizer(tok, table, []), ByteLevelDetokenizer)
    rng = random.Random(7)
    size = len(table.bytes)
    for _ in range(500):
        ids = [rng.randrange(size + 5) for _ in range(rng.randint(1, 24))]
        for skip in (True, False):
            assert table.of(ids, skip).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=skip)


def test_not_byte_level_means_no_table(tok) -> None:
    """A tokenizer whose decoder is not byte-level BPE gets the windowed detokenizer."""
    from tokenizers import Tokenizer, decoders

    other = Tokenizer.from_str(tok.backend_tokenizer.to_str())
    other.decoder = decoders.Metaspace()
    assert byte_table(other) is None
