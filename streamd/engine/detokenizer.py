"""IncrementalDetokenizer: turns one sequence's new token ids into newly complete text, cheaply.

Owns the token -> text step of streaming. Byte-level BPE (GPT-2 style, SmolLM2) and SentencePiece
byte-fallback tokenizers split one character over several tokens, so decoding token by token would emit
half characters (U+FFFD). We use the prefix/read-offset technique (as in vLLM / HF TextStreamer):

- `window` holds the token ids from the *prefix offset* on: a few tokens of already-emitted context followed
  by the unread tokens. Decoding with that context keeps SentencePiece's leading-space handling and
  merges right, and only the text past the context is new.
- Each update decodes the small window twice (context alone, context + unread). If the result ends in
  U+FFFD the last character is still incomplete: emit nothing and wait for more tokens. Otherwise emit
  the new text and slide the window so the just-read tokens become the next context.

The window stays a handful of tokens long, so the cost per token is constant, never a re-decode of the whole
output. Concatenating every `update()` (plus `flush()` at the end) gives `tokenizer.decode(output ids)`
for byte-level BPE tokenizers.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first output tokens (vLLM uses the same number).
_INITIAL_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so at most this many prompt tokens can hold its start.
_MAX_PARTIAL_TOKENS = 4


class IncrementalDetokenizer:
    """Detokenizes one sequence's output as tokens arrive. Not thread-safe; one per sequence."""

    __slots__ = ("tokenizer", "skip_special_tokens", "_window", "_read", "_prefix_len", "_byte_level")

    def __init__(self, tokenizer: Any, prompt_token_ids: Seq[int], skip_special_tokens: bool = True) -> None:
        # The Rust tokenizer under a transformers fast tokenizer: its decode is the same text without the
        # Python wrapper's per-call overhead (about 3x cheaper per token).
        self.tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        # Byte-level BPE decodes token by token into bytes: text that decoded whole is the text of the tokens
        # alone too, so the next context's length is known without decoding it again.
        self._byte_level = type(getattr(self.tokenizer, "decoder", None)).__name__ == "ByteLevel"
        window = list(prompt_token_ids[-(_INITIAL_CONTEXT_TOKENS + _MAX_PARTIAL_TOKENS):])
        read = len(window)
        prefix = self._decode(window[:read])
        # A prompt that ends in the middle of a character (token-id prompts can): treat its trailing
        # partial bytes as unread, so the first output token that completes the character emits it
        # whole instead of the diff of two decodes being shifted by the replacement character.
        backed = 0
        while read > 0 and backed < _MAX_PARTIAL_TOKENS and prefix.endswith(_REPLACEMENT):
            read -= 1
            backed += 1
            prefix = self._decode(window[:read])
        if prefix.endswith(_REPLACEMENT):  # Not a partial character after all: leave the prompt alone.
            read = len(window)
            prefix = self._decode(window)
        # Keep only _INITIAL_CONTEXT_TOKENS of context before the read offset.
        start = max(0, read - _INITIAL_CONTEXT_TOKENS)
        self._window: list[int] = window[start:]
        self._read = read - start  # window[:_read] is context whose text was emitted (or is the prompt's)
        self._prefix_len = len(self._decode(self._window[:self._read])) if start else len(prefix)

    def _decode(self, ids: list[int]) -> str:
        # The Rust decode applies no clean-up of tokenization spaces (which would rewrite text across token
        # boundaries, " ." -> ".", and make windowed decodes disagree with each other).
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: Seq[int]) -> str:
        """Takes the token ids just appended to the sequence; returns the text they complete ("" while
        the last character is still incomplete)."""
        self._window.extend(new_token_ids)
        text = self._decode(self._window)
        if text.endswith(_REPLACEMENT):
            # Incomplete character: keep the unread tokens and try again with the next one.
            return ""
        if len(text) <= self._prefix_len:
            if len(text) == self._prefix_len:
                # Tokens with no text (skipped special tokens, e.g. EOS under ignore_eos): forget them, so
                # a long run of them cannot grow the window, and keep the real context.
                del self._window[self._read:]
            return ""
        new_text = text[self._prefix_len:]
        # Slide: the tokens just read become the context of the next decode.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        if self._byte_level and _REPLACEMENT not in new_text:
            self._prefix_len = len(new_text)
        else:
            self._prefix_len = len(self._decode(self._window))
        return new_text

    def flush(self) -> str:
        """Text still held back (an incomplete character, as U+FFFD); call once when the sequence ends."""
        text = self._decode(self._window)
        new_text = text[self._prefix_len:]
        self._window = self._window[self._read:] if new_text else self._window
        self._read = len(self._window)
        self._prefix_len = len(self._decode(self._window))
        return new_text
