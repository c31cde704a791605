"""StopChecker: the engine's token-level decision that a sequence is finished.

After each appended token: EOS (unless `ignore_eos`, and only once `min_tokens` outputs exist),
`stop_token_ids`, `max_tokens` and the model's context length. These need no text, so they are decided at
once: the checker says why a sequence is done, and the Scheduler (which alone writes statuses) finishes it
and frees its blocks in the same step. Stop *strings* need the detokenized text:
the output processor (`output_processor.py`) finds them and tells the engine to finish the sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamd.engine.core.sequence import Sequence
from streamd.engine.outputs import FinishReason
from streamd.engine.sampling_params import SamplingParams


class StopChecker:
    """Stateless apart from the model's EOS ids and context length; shared by all sequences."""

    __slots__ = ("eos_token_ids", "max_model_len")

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def check(self, seq: Sequence, params: SamplingParams) -> tuple[FinishReason | None, int | None]:
        """Call once after each token appended to `seq`. If the sequence is done, returns ("stop", the stop
        token id or None for EOS) or ("length", None); else (None, None). The caller applies the finish."""
        token_ids = seq.token_ids
        last, num_tokens = token_ids[-1], len(token_ids)
        num_output = num_tokens - len(seq.prompt_token_ids)
        # min_tokens: nothing but the length limits ends a sequence before it has min_tokens outputs.
        if num_output >= params.min_tokens:
            is_eos = not params.ignore_eos and last in self.eos_token_ids
            if is_eos or last in params.stop_token_ids:
                return "stop", None if is_eos else last
        if num_tokens >= self.max_model_len or (params.max_tokens is not None and num_output >= params.max_tokens):
            return "length", None
        return None, None

    def at_length_limit(self, seq: Sequence, params: SamplingParams, pending: int = 0) -> bool:
        """Whether `seq`, with `pending` more tokens appended, has reached max_tokens or the context."""
        if seq.num_tokens + pending >= self.max_model_len:
            return True
        return params.max_tokens is not None and seq.num_output_tokens + pending >= params.max_tokens
