"""Logprobs in OpenAI's shapes, from the engine's per-token `{token_id: logprob}` dicts.

The engine gives, per output token, a dict whose first entries are the top-N tokens (most likely first)
and which always holds the sampled token (appended when it is not among the top N). This module owns
turning those into what OpenAI clients read:

- chat (and the Responses API): `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}` per token, `top_logprobs` being the first `top` entries (OpenAI's `top_logprobs`);
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}`, whose
  `top_logprobs` dicts hold the top N plus the sampled token (OpenAI: "up to logprobs + 1 elements").

A token's text is the tokenizer's decoding of it alone (a byte-level token that holds part of a character
decodes to U+FFFD); its `bytes` are its exact bytes (byte-level BPE: the token's own bytes, so the bytes
of consecutive tokens join into the text). Log probabilities below -9999 (-inf included) are reported as
-9999.0, OpenAI's value for "very unlikely" (JSON has no infinity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamd.engine import CompletionDelta, byte_table

FLOOR = -9999.0  # OpenAI's logprob for a token too unlikely to report


@dataclass(slots=True, frozen=True)
class TokenText:
    text: str
    bytes: list[int]


class TokenTexts:
    """Token id -> its text and bytes, computed once per id (the event loop's tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._table = byte_table(tokenizer)
        self._cache: dict[int, TokenText] = {}

    def get(self, token_id: int) -> TokenText:
        known = self._cache.get(token_id)
        if known is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            data = self._table.of([token_id], False) if self._table is not None else text.encode("utf-8")
            known = self._cache[token_id] = TokenText(text, list(data))
        return known


def _value(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR


def chat_entries(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], top: int
) -> list[dict[str, Any]]:
    """OpenAI's `ChatCompletionTokenLogprob` objects, one per token."""
    entries = []
    for token_id, entry in zip(token_ids, logprobs):
        ranked = list(entry.items())[:top]
        entries.append(
            {
                **_chat_token(texts.get(token_id), entry[token_id]),
                "top_logprobs": [_chat_token(texts.get(t), lp) for t, lp in ranked],
            }
        )
    return entries


def _chat_token(text: TokenText, logprob: float) -> dict[str, Any]:
    return {"token": text.text, "logprob": _value(logprob), "bytes": text.bytes}


@dataclass(slots=True)
class _Pending:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text_offset: int = 0  # completions: where the next token's text starts in the choice's text


class LogprobsBuilder:
    """One OpenAI call's logprobs: takes every delta's tokens, hands out each choice's logprobs object for
    the tokens not yet handed out (a stream: per chunk; otherwise: once, at the end)."""

    def __init__(self, texts: TokenTexts, kind: str, top: int, num_choices: int) -> None:
        self.texts = texts
        self.kind = kind  # "chat" or "completion"
        self.top = top
        self._choices = [_Pending() for _ in range(num_choices)]

    def add(self, choice: CompletionDelta) -> None:
        if choice.logprobs:
            pending = self._choices[choice.index]
            pending.token_ids.extend(choice.token_ids[: len(choice.logprobs)])
            pending.logprobs.extend(choice.logprobs)

    def has_pending(self, index: int) -> bool:
        return bool(self._choices[index].token_ids)

    def take(self, index: int) -> dict[str, Any]:
        pending = self._choices[index]
        token_ids, logprobs = pending.token_ids, pending.logprobs
        pending.token_ids, pending.logprobs = [], []
        if self.kind == "chat":
            return {"content": chat_entries(self.texts, token_ids, logprobs, self.top), "refusal": None}
        return self._completion(pending, token_ids, logprobs)

    def _completion(self, pending: _Pending, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any]:
        tokens, offsets = [], []
        for token_id in token_ids:
            text = self.texts.get(token_id).text
            tokens.append(text)
            offsets.append(pending.text_offset)
            pending.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [_value(entry[t]) for t, entry in zip(token_ids, logprobs)],
            "top_logprobs": [{self.texts.get(t).text: _value(lp) for t, lp in entry.items()} for entry in logprobs],
            "text_offset": offsets,
        }
