"""RequestOutput and CompletionOutput: what the engine reports for a request after each step.

Shaped like vLLM's so users know them. Fields are cumulative (the whole text and token ids so far);
a streaming consumer takes the part past what it already sent. `text` only ever grows by whole
characters: the detokenizer holds back incomplete UTF-8 and a tail that might still become a stop string.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
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
    # Set when the request failed inside the engine (the server turns it into an error event).
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
