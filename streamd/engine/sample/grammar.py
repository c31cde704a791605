"""Structured outputs: grammars compiled from `StructuredOutputs`, one matcher per constrained sequence, and
the token bitmask that gates the sampler.

The grammar engine is xgrammar (chosen by measurement: `benchmarks/NOTES.md`). `GrammarCompiler` turns a
request's `StructuredOutputs` into a compiled grammar; xgrammar's compiler caches them by grammar text (a
schema by its compact JSON text, property order kept), so a schema is compiled once per process.
A schema that cannot be compiled raises `GrammarError` naming the problem; the server compiles before
submitting, so a bad schema is refused before its request takes any KV block.

`GrammarMatchers` (owned by the engine, next to the sampler) keeps a matcher per constrained sequence:
`constrained_rows(seqs)` finds a batch's constrained rows (once a step) and `bitmask(seqs, rows)` fills
their allowed-token bitmask in one call (xgrammar's batch matcher, threads inside, into one reused host
buffer), `accept(seq, token)` advances a matcher with each token the sequence keeps, `fork(parent, child)`
gives a forked sample (or beam) its own copy of the parent's matcher state. Preemption (swap or recompute)
keeps a sequence's tokens, so its matcher stays valid. Unconstrained batches cost one empty-dict check per
step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from streamd.engine.core.sequence import Sequence
from streamd.engine.errors import RequestError
from streamd.engine.sampling_params import StructuredOutputs

_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/")
# Compiling a schema costs time growing steeply with its nesting (one core for ~20 s at 600 levels, on a
# compile thread); real schemas stay far below this.
MAX_SCHEMA_DEPTH = 64
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its message


class GrammarError(RequestError):
    """A structured-output spec that cannot be compiled (bad schema, unsupported feature, bad grammar)."""


@dataclass(slots=True)
class TokenBitmask:
    """Allowed tokens of the constrained rows of one batch: bit t of row i set = token t allowed."""

    mask: torch.Tensor  # int32 [rows, ceil(vocab / 32)], on the logits' device
    rows: list[int]  # the constrained rows (others are left untouched)
    vocab_size: int

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Sets the disallowed logits of the constrained rows to -inf, in place, in one batched call."""
        xgr.apply_token_bitmask_inplace(logits, self.mask, vocab_size=self.vocab_size, indices=self.rows)
        return logits


class GrammarCompiler:
    """StructuredOutputs -> xgrammar CompiledGrammar for one tokenizer; thread-safe, cached by grammar text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2)

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        kind = _kind(spec)
        try:
            if spec.json is not None:
                return self._compiler.compile_json_schema(_schema_text(spec.json), any_whitespace=False)
            if spec.json_object:
                return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if spec.regex is not None:
                return self._compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return self._compiler.compile_regex("|".join(_escape_regex(c) for c in spec.choice))
            assert spec.grammar is not None
            return self._compiler.compile_grammar(spec.grammar)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/its own types: all the spec's fault
            text = str(exc).strip()
            first_line = _LOG_PREFIX.sub("", text.splitlines()[0]) if text else type(exc).__name__
            raise GrammarError(f"structured_outputs.{kind} cannot be compiled: {first_line}") from exc


class GrammarMatchers:
    """The engine's matchers, one per live constrained sequence (by seq_id)."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[int, xgr.GrammarMatcher] = {}
        # xgrammar's default: half the host's cores. At batch 256 a fill is ~0.5 ms of work: on the 2-core
        # development box one thread (what "auto" gives there) fills in 1.0 ms where two take 3.5 ms.
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        # The host bitmask, reused every step (allocating and filling a fresh one costs more than the
        # grammar work itself at batch 256); pinned where it is copied to a GPU. Rows are rewritten by
        # each fill and only the filled rows are applied. Reuse is safe: the engine reads a step's
        # tokens back, so the previous mask's copy has completed, before it fills the next one.
        self._host: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, seq: Sequence, spec: StructuredOutputs) -> None:
        self._matchers[seq.seq_id] = xgr.GrammarMatcher(self.compiler.compile(spec))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child (a sample forked from `parent`) continues from a copy of the parent's matcher state."""
        matcher = self._matchers.get(parent.seq_id)
        if matcher is not None:
            self._matchers[child.seq_id] = matcher.fork()

    def remove(self, seq: Sequence) -> None:
        self._matchers.pop(seq.seq_id, None)

    def clear(self) -> None:
        """Drops every matcher (the engine failed every live request)."""
        self._matchers.clear()

    def constrained_rows(self, seqs: list[Sequence]) -> list[int]:
        """The rows of `seqs` whose sequence is constrained (their masks need their previous tokens; the
        engine computes them once a step and hands them to `bitmask`); `seqs` is not scanned while no
        sequence is (the engine keeps its matchers once a request made them)."""
        matchers = self._matchers
        if not matchers:
            return []
        return [i for i, seq in enumerate(seqs) if seq.seq_id in matchers]

    def accept(self, seq: Sequence, token: int) -> bool:
        """Advances the sequence's matcher (if constrained); False when the grammar does not allow `token`
        (only possible when no token was allowed: a dead end)."""
        matcher = self._matchers.get(seq.seq_id)
        return matcher is None or matcher.accept_token(token)

    def bitmask(
        self, seqs: list[Sequence], rows: list[int], device: torch.device, *, own_buffer: bool = False
    ) -> TokenBitmask | None:
        """The batch's bitmask over `rows` (from `constrained_rows(seqs)`), or None when none of them is
        still constrained (then sampling is untouched). `own_buffer`: fill a fresh host buffer, not the
        reused one (for a second fill in one step: the first one's copy to the device may still read the
        reused buffer)."""
        matchers = self._matchers
        # A sequence that finished since (its token is dropped) has a void row: its matcher may be terminated
        # or gone.
        rows = [i for i in rows if seqs[i].seq_id in matchers and not seqs[i].status.finished]
        if not rows:
            return None
        mask = self._new_mask(len(seqs), device) if own_buffer else self._host_rows(len(seqs), device)
        self._batch.batch_fill_next_token_bitmask([matchers[seqs[i].seq_id] for i in rows], mask, indices=rows)
        if device.type != "cpu":
            mask = mask.to(device, non_blocking=True)
        return TokenBitmask(mask, rows, self.compiler.vocab_size)

    def _host_rows(self, n: int, device: torch.device) -> torch.Tensor:
        """The first n rows of the reused host bitmask (grown, by doubling, when a batch needs more)."""
        if self._host is None or self._host.shape[0] < n:
            self._host = self._new_mask(max(n, 2 * self._host.shape[0] if self._host is not None else 64), device)
        return self._host[:n]

    def _new_mask(self, n: int, device: torch.device) -> torch.Tensor:
        """An unfilled host bitmask of n rows, pinned where it is copied to a GPU."""
        shape = xgr.get_bitmask_shape(n, self.compiler.vocab_size)
        return torch.empty(shape, dtype=torch.int32, pin_memory=device.type == "cuda")


def _kind(spec: StructuredOutputs) -> str:
    for name in ("json", "regex", "choice", "grammar"):
        if getattr(spec, name) is not None:
            return name
    return "json_object"


def _schema_text(schema: dict[str, Any] | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise GrammarError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise GrammarError("structured_outputs.json must be a JSON schema object")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise GrammarError(
            f"structured_outputs.json is nested too deeply ({depth} levels of objects and arrays; "
            f"at most {MAX_SCHEMA_DEPTH})"
        )
    return json.dumps(schema)  # property order is kept: the grammar generates properties in schema order


def _depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON value (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def _escape_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
