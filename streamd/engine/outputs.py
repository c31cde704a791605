"""What flows out of the engine, from the step to the user, in three shapes:

- `RequestUpdate` / `SeqUpdate`: what one engine step produced for a request, per sequence: only the new
  token ids (and their logprobs when asked), plus the finish decided by the engine (EOS, stop token,
  length, abort). Never a copy of what came before.
- `RequestDelta` / `CompletionDelta`: what the output processor makes of an update: newly visible text
  (detokenized, stop strings applied, a possible stop-string prefix held back), the same new token ids,
  and the final finish reason. Streams hand these out; a slow consumer merges them.
- `RequestOutput` / `CompletionOutput`: the offline API's final result (shaped like vLLM's), folded from
  deltas by `RequestOutputBuilder`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Why a sequence ended. "stop": EOS, a stop token or a stop string; "length": max_tokens or the model's
# context; "abort": cancelled, or failed (the request's `error` says so); "timeout": its deadline passed
# (`timeout_s`, or `queue_timeout_s` before it was ever scheduled). The one map between these and the
# sequences' finished statuses is `SequenceStatus.finish_reason` / `SequenceStatus.of_reason` (core.sequence).
FinishReason = Literal["stop", "length", "abort", "timeout"]


@dataclass(slots=True)
class Progress:
    """A request's progress before its first token (`engine/core/progress.py` says when one is made)."""

    queue_position: int | None  # its place among the waiting requests (1: next); None once scheduled
    prompt_tokens_done: int = 0  # prompt tokens whose KV is computed (cached ones included)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied


@dataclass(slots=True)
class SeqUpdate:
    """One sequence's news from one step."""

    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop token (EOS excluded) that ended it


@dataclass(slots=True)
class RequestUpdate:
    """One request's news from one step (only requests that progressed or ended get one)."""

    request_id: str
    seqs: list[SeqUpdate]
    num_cached_tokens: int = 0
    scheduled_time: float | None = None  # monotonic time of its first scheduling, once it has one
    error: str | None = None  # the request failed inside the engine
    # `prompt_logprobs` asked: one entry per prompt token ({token_id: logprob}, the top k then the prompt
    # token's; the first token's None), with the request's first update that carries tokens, once.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    progress: Progress | None = None  # a tokenless update reporting progress before the first token
    # Speculative decoding in this step: draft tokens taken from the request's `prediction`, and how many of
    # them the model accepted (usage's accepted / rejected prediction tokens).
    prediction_tokens: int = 0
    accepted_prediction_tokens: int = 0


@dataclass(slots=True)
class CompletionDelta:
    """What one choice produced since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, float]] | None = None
    num_tokens: int = 0  # cumulative output tokens of this choice

    def merge(self, later: CompletionDelta) -> None:
        self.text += later.text
        _extend(self, later)
        self.num_tokens = later.num_tokens


@dataclass(slots=True)
class RequestDelta:
    """One item of a request's stream: the new part of every choice that progressed."""

    request_id: str
    num_prompt_tokens: int
    outputs: list[CompletionDelta]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling, once known
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first delta (RequestUpdate's)
    progress: Progress | None = None  # the newest progress before the first token (RequestUpdate's)
    prediction_tokens: int = 0  # draft tokens taken from the request's `prediction` (RequestUpdate's)
    accepted_prediction_tokens: int = 0  # those the model accepted

    def merge(self, later: RequestDelta) -> None:
        mine, theirs = self.outputs, later.outputs
        if len(mine) == 1 and len(theirs) == 1 and mine[0].index == theirs[0].index:  # n = 1: the usual case
            mine[0].merge(theirs[0])
        else:
            for choice in theirs:
                same = next((c for c in mine if c.index == choice.index), None)
                if same is None:
                    mine.append(choice)
                else:
                    same.merge(choice)
        self.finished = self.finished or later.finished
        self.error = self.error or later.error
        self.num_cached_tokens = later.num_cached_tokens
        self.queue_time = self.queue_time if later.queue_time is None else later.queue_time
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.progress = later.progress or self.progress
        self.prediction_tokens += later.prediction_tokens
        self.accepted_prediction_tokens += later.accepted_prediction_tokens

    @property
    def num_new_tokens(self) -> int:
        outputs = self.outputs
        return len(outputs[0].token_ids) if len(outputs) == 1 else sum(len(c.token_ids) for c in outputs)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    # The stop string or stop token id that ended the sequence, when one did.
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    # Set when the request failed inside the engine.
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # `prompt_logprobs` asked (vLLM's shape)


@dataclass(slots=True)
class RequestOutputBuilder:
    """Folds one request's deltas into its final `RequestOutput` (text pieces joined once, at the end)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    num_choices: int = 1
    _text: dict[int, list[str]] = field(default_factory=dict)
    _choices: dict[int, CompletionOutput] = field(default_factory=dict)
    _finished: bool = False
    _error: str | None = None
    _num_cached_tokens: int = 0
    _prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, delta: RequestDelta) -> None:
        for part in delta.outputs:
            choice = self._choices.get(part.index)
            if choice is None:
                choice = self._choices[part.index] = CompletionOutput(part.index, "", [])
                self._text[part.index] = []
            self._text[part.index].append(part.text)
            _extend(choice, part)
        self._finished = self._finished or delta.finished
        self._error = self._error or delta.error
        self._num_cached_tokens = delta.num_cached_tokens
        if self._prompt_logprobs is None:
            self._prompt_logprobs = delta.prompt_logprobs

    @property
    def finished(self) -> bool:
        return self._finished

    def build(self) -> RequestOutput:
        choices = []
        for index in range(max(self.num_choices, len(self._choices))):
            choice = self._choices.get(index) or CompletionOutput(index, "", [])
            choice.text = "".join(self._text.get(index, ()))
            choices.append(choice)
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            choices,
            finished=self._finished,
            num_cached_tokens=self._num_cached_tokens,
            error=self._error,
            prompt_logprobs=self._prompt_logprobs,
        )


def _extend(choice: CompletionDelta | CompletionOutput, later: CompletionDelta) -> None:
    """Everything of `later` but its text (joined differently by the two callers) folded into `choice`."""
    choice.token_ids.extend(later.token_ids)
    if later.logprobs is not None:
        if choice.logprobs is None:
            choice.logprobs = []
        choice.logprobs.extend(later.logprobs)
    choice.finish_reason = later.finish_reason or choice.finish_reason
    if later.stop_reason is not None:
        choice.stop_reason = later.stop_reason
