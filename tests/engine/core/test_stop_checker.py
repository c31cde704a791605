"""Stopping, split as the engine splits it: the engine's StopChecker (EOS / ignore_eos / min_tokens,
stop_token_ids, max_tokens, max_model_len) and the output processor's stop strings across token boundaries
(with and without include_stop_str_in_output), the held-back text that never has to be taken back, and the
tail flushed on a length finish. Each test drives both exactly as LLMEngine.step does."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from streamd.engine.core.sequence import Sequence, SequenceStatus
from streamd.engine.core.stop_checker import StopChecker
from streamd.engine.output.output_processor import OutputProcessor, held_back_chars
from streamd.engine.outputs import RequestUpdate, SeqUpdate
from streamd.engine.sampling_params import SamplingParams
from tests.smollm2_tokenizer import smollm2_tokenizer

EOS = 2
PROMPT = [10, 11, 12]


class ChunkTokenizer:
    """decode() is the concatenation of each id's text: one token per chunk of a test's text."""

    def __init__(self, vocab: dict[int, str]) -> None:
        self.vocab = vocab

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.vocab.get(i, "") for i in ids)


@dataclass
class Run:
    seq: Sequence
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    seen: list[str] = field(default_factory=list)  # the streamed text after each step


def _drive(checker: StopChecker, tokenizer, params: SamplingParams, tokens: list[int],
           prompt: list[int] = PROMPT) -> Run:
    seq = Sequence(prompt_token_ids=list(prompt), status=SequenceStatus.RUNNING)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", list(prompt), params, 0.0)
    run = Run(seq)
    for token in tokens:
        seq.append_token(token)
        reason, stop_token = checker.check(seq, params)
        assert seq.status == SequenceStatus.RUNNING, "the checker only says why: the scheduler finishes"
        if reason is not None:
            seq.status = SequenceStatus.of_reason(reason)  # as Scheduler.update_from_output applies it
        step = processor.process([RequestUpdate("r", [SeqUpdate(0, [token], None, reason, stop_token)])])
        for delta in step.deltas:
            for choice in delta.outputs:
                run.text += choice.text
                run.finish_reason = choice.finish_reason or run.finish_reason
                run.stop_reason = choice.stop_reason if choice.stop_reason is not None else run.stop_reason
        if step.stop_hits:
            seq.status = SequenceStatus.FINISHED_STOPPED
        run.seen.append(run.text)
        if seq.status.finished:
            assert run.finish_reason is not None and len(processor) == 0
            break
    return run


def _run(checker: StopChecker, params: SamplingParams, chunks: list[str], tokens: list[int] | None = None,
         prompt: list[int] = PROMPT) -> Run:
    """One token per text chunk (EOS's text is "<eos>")."""
    tokens = tokens or [100 + i for i in range(len(chunks))]
    return _drive(checker, ChunkTokenizer(dict(zip(tokens, chunks))), params, tokens, prompt)


@pytest.fixture
def checker() -> StopChecker:
    return StopChecker({EOS}, max_model_len=64)


def test_eos_stops_with_no_reason_and_no_text(checker) -> None:
    run = _run(checker, SamplingParams(max_tokens=10), ["a", "b", "<eos>", "c"], [5, 6, EOS, 7])
    assert run.seq.status == SequenceStatus.FINISHED_STOPPED and run.stop_reason is None
    assert run.finish_reason == "stop" and run.text == "ab" and run.seq.num_output_tokens == 3


def test_ignore_eos_keeps_going(checker) -> None:
    run = _run(checker, SamplingParams(max_tokens=4, ignore_eos=True), ["a", "", "b", "c"], [5, EOS, 6, 7])
    assert run.seq.status == SequenceStatus.FINISHED_LENGTH and run.seq.num_output_tokens == 4
    assert run.finish_reason == "length" and run.text == "abc"


def test_min_tokens_defers_eos_and_stop_strings(checker) -> None:
    params = SamplingParams(max_tokens=10, min_tokens=3, stop=["x"])
    run = _run(checker, params, ["", "x", "y", "", "z"], [EOS, 5, 6, EOS, 7])
    # Neither the EOS at output 1 nor the "x" at output 2 stop it; the EOS at output 4 does.
    assert run.seq.status == SequenceStatus.FINISHED_STOPPED and run.seq.num_output_tokens == 4
    assert run.text == "xy"


def test_stop_token_ids(checker) -> None:
    run = _run(checker, SamplingParams(stop_token_ids=[42]), ["a", "STOP", "b"], [5, 42, 6])
    assert run.seq.status == SequenceStatus.FINISHED_STOPPED and run.stop_reason == 42
    assert run.text == "a"
    run = _run(checker, SamplingParams(stop_token_ids=[42], include_stop_str_in_output=True),
               ["a", "STOP", "b"], [5, 42, 6])
    assert run.text == "aSTOP" and run.stop_reason == 42


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundaries(checker, include) -> None:
    params = SamplingParams(max_tokens=20, stop=["o wor"], include_stop_str_in_output=include)
    run = _run(checker, params, ["Hel", "lo", " w", "orld", "!"])
    assert run.seq.status == SequenceStatus.FINISHED_STOPPED and run.stop_reason == "o wor"
    assert run.finish_reason == "stop" and run.seq.num_output_tokens == 4
    assert run.text == ("Hello wor" if include else "Hell")


def test_earliest_stop_string_wins_and_rest_of_token_dropped(checker) -> None:
    run = _run(checker, SamplingParams(stop=["cd", "b"]), ["a", "bcd tail"])
    assert run.stop_reason == "b" and run.text == "a"
    run = _run(checker, SamplingParams(stop=["cd"], include_stop_str_in_output=True), ["ab", "cde f"])
    assert run.text == "abcd"


def test_stop_string_spanning_three_tokens(checker) -> None:
    run = _run(checker, SamplingParams(stop=["abcdef"]), ["xab", "cd", "efy"])
    assert run.seq.status == SequenceStatus.FINISHED_STOPPED and run.text == "x"


def test_old_text_is_not_rematched(checker) -> None:
    # Matches are searched only where the new text could complete one: a stop string that appeared
    # before min_tokens was reached does not stop the sequence later.
    params = SamplingParams(max_tokens=5, min_tokens=2, stop=["ab"])
    run = _run(checker, params, ["ab", "c", "d"])
    assert run.seq.status == SequenceStatus.RUNNING and run.text == "abcd"


def test_max_tokens_and_max_model_len(checker) -> None:
    run = _run(checker, SamplingParams(max_tokens=3), ["a"] * 10)
    assert run.seq.status == SequenceStatus.FINISHED_LENGTH and run.seq.num_output_tokens == 3
    assert run.stop_reason is None and run.finish_reason == "length"
    small = StopChecker({EOS}, max_model_len=5)  # prompt is 3 tokens: room for 2 more
    run = _run(small, SamplingParams(max_tokens=None), ["a"] * 10)
    assert run.seq.status == SequenceStatus.FINISHED_LENGTH and run.seq.num_tokens == 5
    # Every token is EOS: only ignore_eos keeps the sequence going, up to the context.
    run = _run(small, SamplingParams(max_tokens=None, ignore_eos=True), ["a"] * 10, tokens=[EOS] * 10)
    assert run.seq.status == SequenceStatus.FINISHED_LENGTH and run.seq.num_tokens == 5
    run = _run(small, SamplingParams(max_tokens=None), ["a"] * 10, tokens=[EOS] * 10)
    assert run.seq.status == SequenceStatus.FINISHED_STOPPED and run.seq.num_tokens == 4


def test_streamed_text_withholds_possible_stop_prefix(checker) -> None:
    params = SamplingParams(max_tokens=20, stop=["world", "STOP"])
    run = _run(checker, params, ["Hello", " wo", "r", "m", " S", "T", "x"])
    assert run.seen == ["Hello", "Hello ", "Hello ", "Hello worm", "Hello worm ", "Hello worm ", "Hello worm STx"]
    assert run.seq.status == SequenceStatus.RUNNING
    # No stop strings: nothing withheld.
    assert _run(checker, SamplingParams(), ["a", "b"]).seen == ["a", "ab"]


def test_held_back_text_comes_out_when_the_sequence_ends(checker) -> None:
    run = _run(checker, SamplingParams(max_tokens=2, stop=["world"]), ["Hello", " wor"])
    assert run.finish_reason == "length" and run.text == "Hello wor"


def test_held_back_chars() -> None:
    assert held_back_chars("say hel", ["hello"]) == 3
    assert held_back_chars("say hello", ["hello"]) == 0  # a whole match is the processor's business
    assert held_back_chars("xxab", ["abc", "bq"]) == 2
    assert held_back_chars("aa", ["aaa"]) == 2
    assert held_back_chars("", ["ab"]) == 0


def test_streamed_text_only_grows_and_ends_at_truncation() -> None:
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
        run = _run(checker, params, chunks)
        for a, b in zip(run.seen, run.seen[1:]):
            assert b.startswith(a), (text, stops, run.seen)
        hits = [(text.find(s), s) for s in stops if s in text]
        if hits:
            index, stop = min(hits, key=lambda h: h[0])
            assert run.text == text[:index + (len(stop) if include else 0)], (text, stops, chunks)
        else:
            assert run.text == text
        assert run.seq.status.finished


def test_stop_strings_with_real_tokenizer() -> None:
    """Tokens from the real tokenizer through the real detokenizer: stop strings that span tokens, one
    that ends inside a multi-byte character's tokens, and a length finish that flushes."""
    tok = smollm2_tokenizer()
    checker = StopChecker({tok.eos_token_id}, max_model_len=4096)
    prompt = tok.encode("Q: what is it?")

    def generate(text: str, params: SamplingParams) -> Run:
        return _drive(checker, tok, params, tok.encode(text), prompt)

    answer = " The answer is 42.\nDone 🎉 with 中文 here."
    run = generate(answer, SamplingParams(max_tokens=100, stop=["42.\nDo"]))
    assert run.stop_reason == "42.\nDo" and run.text == " The answer is "
    assert all("42" not in s for s in run.seen)
    run = generate(answer, SamplingParams(max_tokens=100, stop=["🎉 w"], include_stop_str_in_output=True))
    assert run.text == " The answer is 42.\nDone 🎉 w"
    run = generate(answer, SamplingParams(max_tokens=100, stop=["文"]))
    assert run.text == " The answer is 42.\nDone 🎉 with 中"
    # Length finish in the middle of the emoji's bytes: the held-back bytes come out as U+FFFD, so the
    # text equals the tokenizer's decode of the output tokens.
    ids = tok.encode(answer)
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    run = generate(answer, SamplingParams(max_tokens=cut))
    assert run.seq.status == SequenceStatus.FINISHED_LENGTH
    assert run.text == tok.decode(ids[:cut]) and run.text.endswith("\ufffd")
    assert all("\ufffd" not in s for s in run.seen[:-1])
