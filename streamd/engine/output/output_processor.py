"""OutputProcessor: every request's output state, and the one place where engine updates become deltas.

The engine step reports, per sequence, only its new token ids (and logprobs) and any finish the engine
decided (EOS, stop token, length, abort). This module owns everything a user sees of that:

- the incremental detokenizer of each choice (byte-level BPE through a byte table, else the Rust tokenizer);
- stop strings, matched across token boundaries, and the *held-back* tail: while a choice runs, text that
  could still be the start of a stop string is not handed out, so text once streamed never has to be taken
  back. Only the unsent tail is kept, never the whole text, so a step costs the same at token 10 and 10,000;
- the text of a stop token (dropped unless `include_stop_str_in_output`), the tail flushed on a length,
  timeout or abort finish, the final finish reason and stop reason;
- queue times, cached-token counts, what has been handed out (first-token and inter-token times are
  measured where the deltas are delivered: `streamd.server.accounting`).

`process(updates)` returns the deltas of the step and the sequences that a stop string ended, which the
engine must then finish (free their blocks). Deltas are produced once; streams, the server and the offline
`LLM` all consume the same objects.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from streamd.engine.output.detokenizer import Detokenizer, byte_table, make_detokenizer
from streamd.engine.outputs import CompletionDelta, FinishReason, RequestDelta, RequestUpdate, SeqUpdate
from streamd.engine.sampling_params import SamplingParams


@dataclass(slots=True, frozen=True)
class StopHit:
    """A choice that a stop string ended: the engine must finish that sequence."""

    request_id: str
    index: int


@dataclass(slots=True)
class ChoiceState:
    index: int
    detokenizer: Detokenizer | None
    unsent: str = ""  # text produced but held back: it could still start a stop string
    num_tokens: int = 0
    finish_reason: FinishReason | None = None


@dataclass(slots=True)
class RequestState:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    arrival_time: float
    choices: list[ChoiceState]
    num_unfinished: int
    queue_time: float | None = None
    num_cached_tokens: int = 0


@dataclass(slots=True)
class ProcessedStep:
    deltas: list[RequestDelta] = field(default_factory=list)
    stop_hits: list[StopHit] = field(default_factory=list)


class OutputStage(Protocol):
    """Where the engine hands each step's updates: the `OutputProcessor` (deltas made next to the engine), or,
    when another process makes the deltas, a stage that keeps the updates for it (the engine process's
    `UpdateRelay`). The engine takes it at construction or through `LLMEngine.use_output_stage`."""

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float
    ) -> None: ...

    def process(self, updates: Iterable[RequestUpdate]) -> ProcessedStep: ...


class OutputProcessor:
    """Lives on the engine's thread (next to the engine), one per engine."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._byte_table = byte_table(tokenizer) if tokenizer is not None else None
        self._requests: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float
    ) -> None:
        choices = [ChoiceState(i, self._detokenizer(prompt_token_ids, params)) for i in range(params.n)]
        self._requests[request_id] = RequestState(
            request_id, params, len(prompt_token_ids), arrival_time, choices, len(choices)
        )

    def process(self, updates: Iterable[RequestUpdate]) -> ProcessedStep:
        step = ProcessedStep()
        for update in updates:
            state = self._requests.get(update.request_id)
            if state is None:
                continue
            delta = self._process_request(state, update, step.stop_hits)
            if delta is not None:
                step.deltas.append(delta)
        return step

    # ---- per request ---------------------------------------------------------------------------

    def _process_request(
        self, state: RequestState, update: RequestUpdate, stop_hits: list[StopHit]
    ) -> RequestDelta | None:
        if update.scheduled_time is not None and state.queue_time is None:
            state.queue_time = max(0.0, update.scheduled_time - state.arrival_time)
        state.num_cached_tokens = update.num_cached_tokens or state.num_cached_tokens
        outputs: list[CompletionDelta] = []
        for whole in update.seqs:
            choice = state.choices[whole.index]
            for seq in _stop_string_parts(whole, state.params):
                if choice.finish_reason is not None:
                    break  # a token sampled after a stop string ended the choice: void
                delta = self._process_choice(state, choice, seq)
                if delta.finish_reason is not None:
                    choice.finish_reason = delta.finish_reason
                    state.num_unfinished -= 1
                    if seq.finish_reason is None:  # a stop string: the engine does not know yet
                        stop_hits.append(StopHit(state.request_id, seq.index))
                if outputs and outputs[-1].index == delta.index:  # a final beam: text, then its stop token
                    outputs[-1].merge(delta)
                else:
                    outputs.append(delta)
        if update.error is not None:
            outputs.extend(self._finish_rest(state))
        finished = state.num_unfinished == 0 or update.error is not None
        if finished:
            del self._requests[state.request_id]
        if not outputs and not finished and update.progress is None:
            return None
        return RequestDelta(
            state.request_id,
            state.num_prompt_tokens,
            outputs,
            finished,
            update.error,
            state.num_cached_tokens,
            state.queue_time,
            update.prompt_logprobs,
            update.progress,
            update.prediction_tokens,
            update.accepted_prediction_tokens,
        )

    def _process_choice(self, state: RequestState, choice: ChoiceState, seq: SeqUpdate) -> CompletionDelta:
        params = state.params
        choice.num_tokens += len(seq.token_ids)
        detokenizer, reason = choice.detokenizer, seq.finish_reason
        if reason is None and not params.stop and detokenizer is not None:  # the common case, in short
            return CompletionDelta(
                choice.index,
                detokenizer.update(seq.token_ids),
                seq.token_ids,
                None,
                None,
                seq.logprobs,
                choice.num_tokens,
            )
        new_text = detokenizer.update(seq.token_ids) if detokenizer and seq.token_ids else ""
        stop_reason: int | str | None = seq.stop_token_id
        if reason == "stop":
            # EOS or a stop token: its own text (and anything it completed) is output only when asked for.
            if not params.include_stop_str_in_output:
                new_text = ""
        elif (reason in {"length", "timeout"}) and choice.detokenizer is not None:
            # Every token's text, an incomplete last character included (as U+FFFD).
            new_text += choice.detokenizer.flush()
        text = choice.unsent + new_text
        if params.stop and new_text and choice.num_tokens >= params.min_tokens and reason not in {"abort", "stop"}:
            cut = _find_stop(text, len(new_text), params)
            if cut is not None:
                end, stop_string = cut
                choice.unsent = ""
                return CompletionDelta(
                    choice.index, text[:end], seq.token_ids, "stop", stop_string, seq.logprobs, choice.num_tokens
                )
        if reason is None and params.stop:
            held = held_back_chars(text, params.stop)
            text, choice.unsent = (text[: len(text) - held], text[len(text) - held :]) if held else (text, "")
        else:
            choice.unsent = ""
        return CompletionDelta(choice.index, text, seq.token_ids, reason, stop_reason, seq.logprobs, choice.num_tokens)

    def _finish_rest(self, state: RequestState) -> list[CompletionDelta]:
        """Ends every unfinished choice of a failed request, handing out its held-back text."""
        outputs = []
        for choice in state.choices:
            if choice.finish_reason is None:
                choice.finish_reason = "abort"
                state.num_unfinished -= 1
                outputs.append(CompletionDelta(choice.index, choice.unsent, [], "abort", None, None, choice.num_tokens))
                choice.unsent = ""
        return outputs

    def _detokenizer(self, prompt_token_ids: list[int], params: SamplingParams) -> Detokenizer | None:
        if not params.detokenize:
            return None
        return make_detokenizer(self.tokenizer, self._byte_table, prompt_token_ids, params.skip_special_tokens)


def _stop_string_parts(seq: SeqUpdate, params: SamplingParams) -> list[SeqUpdate]:
    """A run of several new tokens (speculative decoding keeps several per step) meets stop strings one token
    at a time, so that the output ends at the token that completed the stop string, as without the run; and
    a run ending in a stop token comes as its other tokens, then the stop token (whose text is dropped)."""
    last = len(seq.token_ids) - 1
    if last < 1 or not (params.stop or seq.finish_reason is not None):
        return [seq]
    cuts = list(range(last + 1)) if params.stop else [0, last]
    ends = [*cuts[1:], last + 1]
    return [
        SeqUpdate(
            seq.index,
            seq.token_ids[start:end],
            None if seq.logprobs is None else seq.logprobs[start:end],
            seq.finish_reason if end > last else None,
            seq.stop_token_id if end > last else None,
        )
        for start, end in zip(cuts, ends)
    ]


def _find_stop(text: str, num_new_chars: int, params: SamplingParams) -> tuple[int, str] | None:
    """The earliest stop string ending inside the last `num_new_chars` characters of `text`: where the
    output ends (after it when it is included) and the string; None when there is none."""
    best_index, best_stop = -1, ""
    for stop in params.stop:
        # A new match ends inside the new text, so it starts at most len(stop)-1 chars before it.
        index = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
        if index != -1 and (best_index == -1 or index < best_index):
            best_index, best_stop = index, stop
    if best_index == -1:
        return None
    return (best_index + len(best_stop) if params.include_stop_str_in_output else best_index), best_stop


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
