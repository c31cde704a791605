"""Logprobs in OpenAI's shapes, from the engine's per-token `{token_id: logprob}` dicts.

The engine gives, per output token, a dict whose first entries are the top-N tokens (most likely first)
and which always holds the sampled token (appended when it is not among the top N). This module owns
turning those into what OpenAI clients read:

- chat (and the Responses API): `{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}` per token, `top_logprobs` being the first `top` entries (OpenAI's `top_logprobs`);
- completions: `{"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}`, whose
  `top_logprobs` dicts hold the top N plus the sampled token (OpenAI: "up to logprobs + 1 elements"). With
  `echo` the prompt's tokens come first (`add_prompt`, from the engine's prompt logprobs), the first one's
  logprob and top logprobs null, as OpenAI's legacy completions give them;
- vLLM's `prompt_logprobs` on completions (`prompt_entries`): per prompt token null (the first) or
  `{token_id: {"logprob", "rank", "decoded_token"}}`, the prompt token's and the top N (rank: its place in
  the top N, 1 the most likely; null for the prompt token when it is not among them).

A token's text is the tokenizer's decoding of it alone (a byte-level token that holds part of a character
decodes to U+FFFD); its `bytes` are its exact bytes (byte-level BPE: the token's own bytes, so the bytes
of consecutive tokens join into the text). Log probabilities below -9999 (-inf included) are reported as
-9999.0, OpenAI's value for "very unlikely" (JSON has no infinity).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

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


def top_entry(entry: dict[int, float], token_id: int, top: int) -> dict[int, float]:
    """An engine entry (ranked top N, then the token's) cut to its top `top` plus the token's."""
    cut = dict(list(entry.items())[:top])
    cut.setdefault(token_id, entry[token_id])
    return cut


def prompt_entries(
    texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float] | None], top: int
) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs` of a completion choice: null for the first prompt token, then per token
    `{id: {"logprob", "rank", "decoded_token"}}` (JSON keys are the ids' decimal strings)."""
    out: list[dict[str, Any] | None] = []
    for token_id, entry in zip(token_ids, logprobs):
        if entry is None:
            out.append(None)
            continue
        ranked = list(entry)[:top]
        item = {}
        for t, lp in top_entry(entry, token_id, top).items():
            rank = ranked.index(t) + 1 if t in ranked else None
            item[str(t)] = {"logprob": _value(lp), "rank": rank, "decoded_token": texts.get(t).text}
        out.append(item)
    return out


@dataclass(slots=True)
class _Pending:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)  # None: the first prompt token's
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

    def add_prompt(self, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> None:
        """Completions' `echo`: the prompt's tokens go first in every choice's logprobs."""
        entries = [None if e is None else top_entry(e, t, self.top) for t, e in zip(token_ids, logprobs)]
        for pending in self._choices:
            pending.token_ids[:0] = token_ids
            pending.logprobs[:0] = entries

    def has_pending(self, index: int) -> bool:
        return bool(self._choices[index].token_ids)

    def take(self, index: int) -> dict[str, Any]:
        pending = self._choices[index]
        token_ids, logprobs = pending.token_ids, pending.logprobs
        pending.token_ids, pending.logprobs = [], []
        if self.kind == "chat":
            entries = cast(list[dict[int, float]], logprobs)  # (only completions' echo has None entries)
            return {"content": chat_entries(self.texts, token_ids, entries, self.top), "refusal": None}
        return self._completion(pending, token_ids, logprobs)

    def _completion(
        self, pending: _Pending, token_ids: list[int], logprobs: list[dict[int, float] | None]
    ) -> dict[str, Any]:
        tokens, offsets = [], []
        for token_id in token_ids:
            text = self.texts.get(token_id).text
            tokens.append(text)
            offsets.append(pending.text_offset)
            pending.text_offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else _value(e[t]) for t, e in zip(token_ids, logprobs)],
            "top_logprobs": [
                None if e is None else {self.texts.get(t).text: _value(lp) for t, lp in e.items()} for e in logprobs
            ],
            "text_offset": offsets,
        }
