"""StopChecker: decides when a sequence is finished, and which part of its text may be shown yet.

Owns, after each appended token: EOS (unless `ignore_eos`, and only once `min_tokens` outputs exist),
`stop_token_ids`, `stop` strings (matched across token boundaries), `max_tokens` and `max_model_len`; and
`seq.output_text`, the full detokenized output (truncated at the stop string once one matched).

Also owns the *visible text* policy (`visible_text`): while a sequence runs, its tail that could still be
the start of a stop string is withheld, so text once streamed never has to be taken back.

Per step, for each sequence that sampled, the engine does, in this order:
    token = sampler(...).token_ids[i]; seq.append_token(token)            # sample, append
    new_text = seq.detokenizer.update([token]) if seq.detokenizer else ""  # detokenize
    seq.output_text += new_text                                            #   (or .step(seq.token_ids))
    stop_checker.check(seq, params, new_text)                              # may finish, fixes the text
    text = visible_text(seq, params)                                       # what may be streamed
"""

from __future__ import annotations

from collections.abc import Iterable

from streamd.engine.sampling_params import SamplingParams
from streamd.engine.sequence import Sequence, SequenceStatus


class StopChecker:
    """Stateless apart from the model's EOS ids and context length; shared by all sequences."""

    __slots__ = ("eos_token_ids", "max_model_len")

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, params: SamplingParams, new_text: str) -> None:
        """Call once after each token appended to `seq`, after the engine appended the text the
        detokenizer returned for it (`new_text`) to `seq.output_text`.

        If the sequence is done, sets `seq.status` to FINISHED_STOPPED (stop_reason: None for EOS, the
        token id for a stop token, the string for a stop string) or FINISHED_LENGTH (stop_reason None),
        and fixes up `seq.output_text` (cut at a stop string, stop token's text removed, held-back
        incomplete character flushed on a length finish).
        """
        last = seq.last_token_id
        # min_tokens: nothing but the length limits ends a sequence before it has min_tokens outputs
        # (the sampler masks EOS and stop tokens until then, so this only matters for stop strings).
        may_stop = seq.num_output_tokens >= params.min_tokens

        is_eos = not params.ignore_eos and last in self.eos_token_ids
        if may_stop and (is_eos or last in params.stop_token_ids):
            # The stop token's own text (e.g. "<|im_end|>" when special tokens are kept) is not output
            # unless asked for, like a stop string. Anything it completed goes with it (as vLLM).
            if new_text and not params.include_stop_str_in_output:
                seq.output_text = seq.output_text[:-len(new_text)]
            seq.status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = None if is_eos else last
            return

        if may_stop and params.stop and new_text and self._stop_at_string(seq, params, len(new_text)):
            return

        if self.at_length_limit(seq, params):
            # A length finish keeps every token's text, including an incomplete last character
            # (as U+FFFD), so the final text equals the tokenizer's decode of all output tokens.
            tail = seq.detokenizer.flush() if seq.detokenizer is not None else ""
            if tail:
                seq.output_text += tail
                if may_stop and params.stop and self._stop_at_string(seq, params, len(tail)):
                    return
            seq.status = SequenceStatus.FINISHED_LENGTH
            seq.stop_reason = None

    def at_length_limit(self, seq: Sequence, params: SamplingParams, pending: int = 0) -> bool:
        """Whether `seq`, with `pending` more tokens appended, has reached max_tokens or the context."""
        if seq.num_tokens + pending >= self.max_model_len:
            return True
        return params.max_tokens is not None and seq.num_output_tokens + pending >= params.max_tokens

    @staticmethod
    def _stop_at_string(seq: Sequence, params: SamplingParams, num_new_chars: int) -> bool:
        """Finds the earliest stop string completed by the last `num_new_chars` characters; finishes
        and truncates the text there. Only the tail that could hold a new match is searched."""
        text = seq.output_text
        best_index, best_stop = -1, ""
        for stop in params.stop:
            # A new match must end inside the new text, so it starts at most len(stop)-1 chars before it.
            start = max(0, len(text) - num_new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index != -1 and (best_index == -1 or index < best_index):
                best_index, best_stop = index, stop
        if best_index == -1:
            return False
        end = best_index + len(best_stop) if params.include_stop_str_in_output else best_index
        seq.output_text = text[:end]
        seq.status = SequenceStatus.FINISHED_STOPPED
        seq.stop_reason = best_stop
        return True


def held_back_chars(text: str, stops: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string: the part that
    a later token could still turn into a stop string (and so would have to be taken back)."""
    held = 0
    for stop in stops:
        # Longest candidates first; the first that matches is this stop string's answer.
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


def visible_text(seq: Sequence, params: SamplingParams) -> str:
    """The part of `seq.output_text` that may be shown now. It only ever grows by appending: the whole
    text once finished; while running, everything but a tail that could still start a stop string."""
    text = seq.output_text
    if seq.status.finished or not params.stop:
        return text
    held = held_back_chars(text, params.stop)
    return text[:len(text) - held] if held else text
