"""Incremental detokenizers: turn one sequence's new token ids into newly complete text, cheaply.

Owns the token -> text step of streaming, in two forms; `make_detokenizer` picks one per sequence.

**Byte-level BPE** (GPT-2 style: SmolLM2, Llama 3, Qwen): the tokenizer's decode is, by construction, the
tokens' bytes joined and read as UTF-8 with replacement characters. `ByteTable` holds every token's bytes
(built once per tokenizer by the Rust decoder's own rule, and checked against its decode of every id), and
`ByteLevelDetokenizer` feeds them to Python's incremental UTF-8 decoder, which holds back an incomplete
character until its last byte arrives: one list index and one C call per token (several times cheaper than
a windowed decode through the Rust tokenizer: benchmarks/NOTES.md), the same text.

**Any other tokenizer** (`IncrementalDetokenizer`): Byte-level BPE (GPT-2 style, SmolLM2) and SentencePiece
byte-fallback tokenizers split one character over several tokens, so decoding token by token would emit
half characters (U+FFFD). We use the prefix/read-offset technique (as in vLLM / HF TextStreamer):

- `window` holds the token ids from the *prefix offset* on: a few tokens of already-emitted context followed
  by the unread tokens. Decoding with that context keeps SentencePiece's leading-space handling and
  merges right, and only the text past the context is new.
- Each update decodes the small window twice (context alone, context + unread). If the result ends in
  U+FFFD the last character is still incomplete: emit nothing and wait for more tokens. Otherwise emit
  the new text and slide the window so the just-read tokens become the next context.

The window stays a handful of tokens long, so the cost per token is constant, never a re-decode of the whole
output.

Both: concatenating every `update()` (plus `flush()` at the end) gives `tokenizer.decode(output ids)`; a
piece never ends in U+FFFD (a replacement character waits for the next piece, as an incomplete one would).
"""

from __future__ import annotations

import codecs
import weakref
from collections.abc import Sequence as Seq
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context for the first output tokens (vLLM uses the same number).
_INITIAL_CONTEXT_TOKENS = 5
# A UTF-8 character has at most 4 bytes, so at most this many prompt tokens can hold its start.
_MAX_PARTIAL_TOKENS = 4


class IncrementalDetokenizer:
    """Detokenizes one sequence's output as tokens arrive. Not thread-safe; one per sequence."""

    __slots__ = ("_prefix_len", "_read", "_window", "skip_special_tokens", "tokenizer")

    def __init__(self, tokenizer: Any, prompt_token_ids: Seq[int], skip_special_tokens: bool = True) -> None:
        # The Rust tokenizer under a transformers fast tokenizer: its decode is the same text without the
        # Python wrapper's per-call overhead (about 3x cheaper per token).
        self.tokenizer = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self.skip_special_tokens = skip_special_tokens
        window = list(prompt_token_ids[-(_INITIAL_CONTEXT_TOKENS + _MAX_PARTIAL_TOKENS) :])
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
        self._prefix_len = len(self._decode(self._window[: self._read])) if start else len(prefix)

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
                del self._window[self._read :]
            return ""
        new_text = text[self._prefix_len :]
        # Slide: the tokens just read become the context of the next decode.
        self._window = self._window[self._read :]
        self._read = len(self._window)
        self._prefix_len = len(self._decode(self._window))
        return new_text

    def flush(self) -> str:
        """Text still held back (an incomplete character, as U+FFFD); call once when the sequence ends."""
        text = self._decode(self._window)
        new_text = text[self._prefix_len :]
        self._window = self._window[self._read :] if new_text else self._window
        self._read = len(self._window)
        self._prefix_len = len(self._decode(self._window))
        return new_text


class Detokenizer(Protocol):
    def update(self, new_token_ids: Seq[int]) -> str: ...

    def flush(self) -> str: ...


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's table: printable
    Latin-1 bytes stand for themselves, the others for code points 256, 257, ... in byte order)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in kept}
    shifted = (b for b in range(256) if b not in set(kept))
    alphabet.update((chr(256 + n), b) for n, b in enumerate(shifted))
    return alphabet


class ByteTable:
    """Every token's bytes under a byte-level BPE decoder, and the same with special tokens as no bytes
    (what `skip_special_tokens` decodes). Ids past the tokenizer's vocabulary decode to nothing, as there."""

    __slots__ = ("bytes", "skipping")

    def __init__(self, token_bytes: list[bytes], special_ids: set[int]) -> None:
        self.bytes = token_bytes
        self.skipping = [b"" if i in special_ids else b for i, b in enumerate(token_bytes)]

    def of(self, token_ids: Seq[int], skip_special_tokens: bool) -> bytes:
        table = self.skipping if skip_special_tokens else self.bytes
        try:
            if len(token_ids) == 1:  # a decode step's usual update
                return table[token_ids[0]]
            return b"".join([table[i] for i in token_ids])
        except IndexError:
            pass
        return b"".join([table[i] if 0 <= i < len(table) else b"" for i in token_ids])


_TABLES: weakref.WeakKeyDictionary[Any, ByteTable | None] = weakref.WeakKeyDictionary()


def byte_table(tokenizer: Any) -> ByteTable | None:
    """The tokenizer's `ByteTable` (built once per tokenizer), or None when it is not byte-level BPE or its
    decode of some token disagrees with the table."""
    try:
        return _TABLES[tokenizer]
    except (KeyError, TypeError):
        pass
    table = _build_byte_table(getattr(tokenizer, "backend_tokenizer", tokenizer))
    try:
        _TABLES[tokenizer] = table
    except TypeError:  # an object without weak references: built again next time
        pass
    return table


def _build_byte_table(backend: Any) -> ByteTable | None:
    # The Rust ByteLevel decoder: a token whose characters are all stand-ins is their bytes, any other
    # token (an added token such as "<|im_start|>") its own UTF-8; the joined bytes are read lossily.
    if type(getattr(backend, "decoder", None)).__name__ != "ByteLevel" or not hasattr(backend, "id_to_token"):
        return None
    alphabet = byte_level_alphabet()
    token_bytes = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        piece = backend.id_to_token(token_id) or ""
        try:
            token_bytes.append(bytes([alphabet[c] for c in piece]))
        except KeyError:
            token_bytes.append(piece.encode("utf-8"))
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    table = ByteTable(token_bytes, special)
    for token_id, data in enumerate(token_bytes):  # the Rust decode of each token alone must agree
        if data.decode("utf-8", "replace") != backend.decode([token_id], skip_special_tokens=False):
            return None
    return table


class ByteLevelDetokenizer:
    """Detokenizes one sequence of a byte-level BPE tokenizer through its `ByteTable`. One per sequence."""

    __slots__ = ("_held", "_utf8", "skip_special_tokens", "table")

    def __init__(self, table: ByteTable, prompt_token_ids: Seq[int], skip_special_tokens: bool = True) -> None:
        self.table = table
        self.skip_special_tokens = skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""  # trailing U+FFFDs, handed out with the next piece
        # A prompt that ends inside a character (token-id prompts can): its first bytes wait in the decoder,
        # so the output token that completes the character emits it whole.
        tail = table.of(prompt_token_ids[-_MAX_PARTIAL_TOKENS:], skip_special_tokens)
        start = _last_character_start(tail)
        if start is not None:
            self._utf8.decode(tail[start:])

    def update(self, new_token_ids: Seq[int]) -> str:
        text = self._held + self._utf8.decode(self.table.of(new_token_ids, self.skip_special_tokens))
        if text.endswith(_REPLACEMENT):
            piece = text.rstrip(_REPLACEMENT)
            self._held = text[len(piece) :]
            return piece
        self._held = ""
        return text

    def flush(self) -> str:
        text, self._held = self._held + self._utf8.decode(b"", final=True), ""
        return text


def _last_character_start(data: bytes) -> int | None:
    """Where an incomplete UTF-8 character at the end of `data` starts (None: it ends on a boundary)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 != 0x80:  # not a continuation byte: a lead byte (or ASCII)
            need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
            return len(data) - back if need > back else None
    return None


def make_detokenizer(
    tokenizer: Any, table: ByteTable | None, prompt_token_ids: Seq[int], skip_special_tokens: bool = True
) -> Detokenizer:
    """The byte-level detokenizer when the tokenizer has a `ByteTable`, else the windowed one."""
    if table is not None:
        return ByteLevelDetokenizer(table, prompt_token_ids, skip_special_tokens)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
