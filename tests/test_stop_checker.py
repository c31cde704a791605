"""StopChecker: EOS / ignore_eos / min_tokens, stop_token_ids, stop strings across token boundaries (with
and without include_stop_str_in_output), max_tokens, max_model_len, and the visible-text policy that never
has to take streamed text back."""

from __future__ import annotations

import random

import pytest

from streamd.engine.detokenizer import IncrementalDetokenizer
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.sequence import Sequence, SequenceStatus
from streamd.engine.stop_checker import StopChecker, held_back_chars, visible_text
from tests.smollm2_tokenizer import smollm2_tokenizer

EOS = 2
PROMPT = [10, 11, 12]


def _run(checker: StopChecker, params: SamplingParams, chunks: list[str], tokens: list[int] | None = None,
         prompt: list[int] = PROMPT) -> tuple[Sequence, list[str]]:
    """Appends one token per text chunk the way the engine does; returns the seq and the visible text
    after each step (stopping when the seq finishes)."""
    seq = Sequence(prompt_token_ids=list(prompt), status=SequenceStatus.RUNNING)
    tokens = tokens or [100 + i for i in range(len(chunks))]
    seen = []
    for token, chunk in zip(tokens, chunks):
        seq.append_token(token)
        seq.output_text += chunk
        checker.check(seq, params, chunk)
        seen.append(visible_text(seq, params))
        if seq.status.finished:
            break
    return seq, seen


@pytest.fixture
def checker() -> StopChecker:
    return StopChecker({EOS}, max_model_len=64)


def test_eos_stops_with_no_reason_and_no_text(checker) -> None:
    seq, _ = _run(checker, SamplingParams(max_tokens=10), ["a", "b", "<eos>", "c"], [5, 6, EOS, 7])
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason is None
    assert seq.output_text == "ab" and seq.num_output_tokens == 3


def test_ignore_eos_keeps_going(checker) -> None:
    seq, _ = _run(checker, SamplingParams(max_tokens=4, ignore_eos=True), ["a", "", "b", "c"], [5, EOS, 6, 7])
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 4
    assert seq.output_text == "abc"


def test_min_tokens_defers_eos_and_stop_strings(checker) -> None:
    params = SamplingParams(max_tokens=10, min_tokens=3, stop=["x"])
    seq, _ = _run(checker, params, ["", "x", "y", "", "z"], [EOS, 5, 6, EOS, 7])
    # Neither the EOS at output 1 nor the "x" at output 2 stop it; the EOS at output 4 does.
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.num_output_tokens == 4
    assert seq.output_text == "xy"


def test_stop_token_ids(checker) -> None:
    seq, _ = _run(checker, SamplingParams(stop_token_ids=[42]), ["a", "STOP", "b"], [5, 42, 6])
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == 42
    assert seq.output_text == "a"
    seq, _ = _run(checker, SamplingParams(stop_token_ids=[42], include_stop_str_in_output=True),
                  ["a", "STOP", "b"], [5, 42, 6])
    assert seq.output_text == "aSTOP" and seq.stop_reason == 42


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(checker, include) -> None:
    params = SamplingParams(max_tokens=20, stop=["o wor"], include_stop_str_in_output=include)
    seq, seen = _run(checker, params, ["Hel", "lo", " w", "orld", "!"])
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "o wor"
    assert seq.num_output_tokens == 4
    assert seq.output_text == ("Hello wor" if include else "Hell")
    assert seen[-1] == seq.output_text


def test_earliest_stop_string_wins_and_rest_of_token_dropped(checker) -> None:
    params = SamplingParams(stop=["cd", "b"])
    seq, _ = _run(checker, params, ["a", "bcd tail"])
    assert seq.stop_reason == "b" and seq.output_text == "a"
    seq, _ = _run(checker, SamplingParams(stop=["cd"], include_stop_str_in_output=True), ["ab", "cde f"])
    assert seq.output_text == "abcd"


def test_stop_string_spanning_three_tokens(checker) -> None:
    seq, _ = _run(checker, SamplingParams(stop=["abcdef"]), ["xab", "cd", "efy"])
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.output_text == "x"


def test_old_text_is_not_rematched(checker) -> None:
    # Matches are searched only where the new text could complete one: a stop string that appeared
    # before min_tokens was reached does not stop the sequence later.
    params = SamplingParams(max_tokens=5, min_tokens=2, stop=["ab"])
    seq, _ = _run(checker, params, ["ab", "c", "d"])
    assert seq.status == SequenceStatus.RUNNING and seq.output_text == "abcd"


def test_max_tokens_and_max_model_len(checker) -> None:
    seq, _ = _run(checker, SamplingParams(max_tokens=3), ["a"] * 10)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_output_tokens == 3
    assert seq.stop_reason is None
    small = StopChecker({EOS}, max_model_len=5)  # prompt is 3 tokens: room for 2 more
    seq, _ = _run(small, SamplingParams(max_tokens=None), ["a"] * 10)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 5
    # Every token is EOS: only ignore_eos keeps the sequence going, up to the context.
    seq, _ = _run(small, SamplingParams(max_tokens=None, ignore_eos=True), ["a"] * 10, tokens=[EOS] * 10)
    assert seq.status == SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 5
    seq, _ = _run(small, SamplingParams(max_tokens=None), ["a"] * 10, tokens=[EOS] * 10)
    assert seq.status == SequenceStatus.FINISHED_STOPPED and seq.num_tokens == 4


def test_visible_text_withholds_possible_stop_prefix(checker) -> None:
    params = SamplingParams(max_tokens=20, stop=["world", "STOP"])
    seq, seen = _run(checker, params, ["Hello", " wo", "r", "m", " S", "T", "x"])
    assert seen == ["Hello", "Hello ", "Hello ", "Hello worm", "Hello worm ", "Hello worm ", "Hello worm STx"]
    assert seq.status == SequenceStatus.RUNNING
    # No stop strings: nothing withheld.
    seq, seen = _run(checker, SamplingParams(), ["a", "b"])
    assert seen == ["a", "ab"]


def test_held_back_chars() -> None:
    assert held_back_chars("say hel", ["hello"]) == 3
    assert held_back_chars("say hello", ["hello"]) == 0  # a whole match is the checker's business
    assert held_back_chars("xxab", ["abc", "bq"]) == 2
    assert held_back_chars("aa", ["aaa"]) == 2
    assert held_back_chars("", ["ab"]) == 0


def test_visible_text_only_grows_and_ends_at_truncation() -> None:
    """Random texts over a tiny alphabet, random token chunking, random stop strings: streamed text is
    always a prefix of every later one and of the final text, which is cut at the first stop string."""
    rng = random.Random(7)
    checker = StopChecker({EOS}, max_model_len=10_000)
    for _ in range(300):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        include = rng.random() < 0.5
        chunks, i = [], 0
        while i < len(text):
            k = rng.randint(1, 5)
            chunks.append(text[i:i + k])
            i += k
        params = SamplingParams(max_tokens=len(chunks), stop=stops, include_stop_str_in_output=include)
        seq, seen = _run(checker, params, chunks)
        for a, b in zip(seen, seen[1:]):
            assert b.startswith(a), (text, stops, seen)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            index, stop = min(hits, key=lambda h: h[0])
            assert seq.output_text == text[:index + (len(stop) if include else 0)], (text, stops, chunks)
        else:
            assert seq.output_text == text
        assert seq.status.finished and seen[-1] == seq.output_text


def test_stop_strings_with_real_tokenizer() -> None:
    """Tokens from the real tokenizer through the real detokenizer: stop strings that span tokens, one
    that ends inside a multi-byte character's tokens, and a length finish that flushes."""
    tok = smollm2_tokenizer()
    checker = StopChecker({tok.eos_token_id}, max_model_len=4096)
    prompt = tok.encode("Q: what is it?")

    def generate(text: str, params: SamplingParams) -> tuple[Sequence, list[str]]:
        seq = Sequence(prompt_token_ids=list(prompt), status=SequenceStatus.RUNNING)
        seq.detokenizer = IncrementalDetokenizer(tok, prompt)
        seen = []
        for t in tok.encode(text):
            seq.append_token(t)
            new_text = seq.detokenizer.update([t])
            seq.output_text += new_text
            checker.check(seq, params, new_text)
            seen.append(visible_text(seq, params))
            if seq.status.finished:
                break
        return seq, seen

    answer = " The answer is 42.\nDone 🎉 with 中文 here."
    seq, seen = generate(answer, SamplingParams(max_tokens=100, stop=["42.\nDo"]))
    assert seq.stop_reason == "42.\nDo" and seq.output_text == " The answer is "
    assert all("42" not in s for s in seen)
    seq, _ = generate(answer, SamplingParams(max_tokens=100, stop=["🎉 w"], include_stop_str_in_output=True))
    assert seq.output_text == " The answer is 42.\nDone 🎉 w"
    seq, _ = generate(answer, SamplingParams(max_tokens=100, stop=["文"]))
    assert seq.output_text == " The answer is 42.\nDone 🎉 with 中"
    # Length finish in the middle of the emoji's bytes: the held-back bytes come out as U+FFFD, so the
    # text equals the tokenizer's decode of the output tokens.
    ids = tok.encode(answer)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    seq, seen = generate(answer, SamplingParams(max_tokens=cut))
    assert seq.status == SequenceStatus.FINISHED_LENGTH
    assert seq.output_text == tok.decode(ids[:cut]) and seq.output_text.endswith("\ufffd")
    assert all("\ufffd" not in s for s in seen[:-1])
