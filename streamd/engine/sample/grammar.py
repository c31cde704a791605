"""Structured outputs: grammars compiled from `StructuredOutputs`, one matcher per constrained sequence, and
the token bitmask that gates the sampler.

The grammar engine is xgrammar (chosen by measurement: `benchmarks/NOTES.md`). `GrammarCompiler` turns a
request's `StructuredOutputs` into a compiled grammar; xgrammar's compiler caches them by grammar text (a
schema by its compact JSON text, property order kept), up to `grammar.cache_bytes` (least recently used
evicted), so a schema is compiled once per process while it is in use. A spec over the compile budget
(`grammar_budget.py`) or that cannot be compiled raises `GrammarError` naming the problem; the server compiles
before submitting, so a bad schema is refused before its request takes any KV block.

`Grammars` is the engine's structured-output lifecycle, one object with a hook for each moment of a request:
`compile` (the server's, before submitting), `add` (admission: a matcher per sequence), `fork_samples` /
`advance_beams` (forked samples and beams take a copy of their parent's state), `drop` (samples that were
never forked), `remove` (the request registry's teardown), `clear` (every request failed). It makes the
matchers with the first constrained request (that costs ~1 s) and is otherwise inert: unconstrained traffic
costs the engine one check a step.

`GrammarMatchers` (made by `Grammars`) keeps a matcher per constrained sequence:
`constrained_rows(seqs)` finds a batch's constrained rows (once a step) and `bitmask(seqs, rows)` fills
their allowed-token bitmask in one call (xgrammar's batch matcher, threads inside, into one reused host
buffer); `draft_bitmask(items)` fills a speculative step's verify rows (each matcher walks its drafts and is
rolled back), `accept(seq, token)` advances a matcher with each token the sequence keeps, `fork(parent, child)`
gives a forked sample (or beam) its own copy of the parent's matcher state. Preemption (swap or recompute)
keeps a sequence's tokens, so its matcher stays valid. Unconstrained batches cost one empty-dict check per
step.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import xgrammar as xgr

from streamd.engine.core.requests import Request
from streamd.engine.core.scheduler_output import ScheduledSeq
from streamd.engine.core.sequence import Sequence, SequenceGroup, SequenceStatus
from streamd.engine.errors import RequestError
from streamd.engine.sample.grammar_budget import GrammarBudget, GrammarError, grammar_size
from streamd.engine.sampling_params import SamplingParams, StructuredOutputs

_REGEX_SPECIAL = frozenset("\\^$.|?*+()[]{}/")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before its message


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
    """StructuredOutputs -> xgrammar CompiledGrammar for one tokenizer; thread-safe, cached by grammar text
    (at most `cache_bytes` of compiled grammars, least recently used evicted). A spec over `budget` is refused
    before xgrammar sees it."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], budget: GrammarBudget, cache_bytes: int
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = vocab_size
        self.budget = budget
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=cache_bytes)

    def cache_bytes(self) -> int:
        """What the compiled-grammar cache holds now."""
        return int(self._compiler.get_cache_size_bytes())

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        size = grammar_size(spec)
        self.budget.check(size)
        kind = size.kind
        try:
            if size.schema is not None:  # (property order kept: the grammar generates them in schema order)
                return self._compiler.compile_json_schema(size.schema, any_whitespace=False)
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
        # xgrammar's default: half the host's cores. A batch's fill is little work, so on a small host one
        # thread (what "auto" gives a 2-core one) beats two (the measurement: benchmarks/NOTES.md).
        self._batch = xgr.BatchGrammarMatcher(max_threads="auto")
        # The host bitmask, reused every step (allocating and filling a fresh one costs more than the
        # grammar work itself at batch 256); pinned where it is copied to a GPU. Rows are rewritten by
        # each fill and only the filled rows are applied. Reuse is safe: the engine reads a step's
        # tokens back, so the previous mask's copy has completed, before it fills the next one.
        self._host: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, seq: Sequence, grammar: xgr.CompiledGrammar) -> None:
        self._matchers[seq.seq_id] = xgr.GrammarMatcher(grammar)

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

    def draft_bitmask(self, items: list[ScheduledSeq], device: torch.device) -> TokenBitmask | None:
        """The bitmask of a speculative step's verify rows (k + 1 per item with drafts, item after item), or
        None when no item is constrained: row j of a constrained item allows what its grammar allows after
        its first j drafts. Each matcher walks the drafts and is rolled back: only the tokens the step keeps
        advance it (`accept`, after verification)."""
        rows: list[int] = []
        walks: list[tuple[xgr.GrammarMatcher, list[int], int]] = []
        total = 0
        for item in items:
            assert item.draft is not None
            matcher = self._matchers.get(item.seq.seq_id)
            count = len(item.draft.token_ids) + 1
            if matcher is not None and not item.seq.status.finished:
                walks.append((matcher, item.draft.token_ids, total))
                rows += range(total, total + count)
            total += count
        if not walks:
            return None
        mask = self._new_mask(total, device)
        for matcher, drafts, first in walks:
            _walk_drafts(matcher, drafts, mask, first)
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


class Grammars:
    """The engine's grammar lifecycle (see the module docstring); thread-safe `compile`, everything else on
    the engine's thread."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        budget: GrammarBudget,
        cache_bytes: int,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = frozenset(eos_token_ids)
        self._budget = budget
        self._cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self.matchers: GrammarMatchers | None = None  # made by the first constrained request

    def __len__(self) -> int:
        """Live matchers (one per constrained sequence)."""
        return len(self.matchers) if self.matchers is not None else 0

    @property
    def compiler(self) -> GrammarCompiler:
        return self._made().compiler

    def cache_bytes(self) -> int:
        """Bytes of compiled grammars cached now (0 before the first constrained request)."""
        return self.matchers.compiler.cache_bytes() if self.matchers is not None else 0

    def compile(self, params: SamplingParams) -> None:
        """Compiles (and caches) the request's grammar, if any; raises GrammarError naming what is wrong."""
        if params.structured_outputs is not None:
            self._made().compiler.compile(params.structured_outputs)

    def _made(self) -> GrammarMatchers:
        with self._lock:
            if self.matchers is None:
                if self._tokenizer is None or not self._eos_token_ids:
                    raise RequestError(
                        "structured_outputs needs a tokenizer and an end-of-sequence token; this model lacks one"
                    )
                compiler = GrammarCompiler(
                    self._tokenizer, self._vocab_size, self._eos_token_ids, self._budget, self._cache_bytes
                )
                self.matchers = GrammarMatchers(compiler)
            return self.matchers

    # ---- a request's moments ------------------------------------------------------------------

    def add(self, group: SequenceGroup) -> None:
        """A constrained request's sequences get their matchers (a bad grammar raises before any is made)."""
        spec = group.sampling_params.structured_outputs
        if spec is not None:
            matchers = self._made()
            grammar = matchers.compiler.compile(spec)  # once for all its sequences (cached by text)
            for seq in group.seqs:
                matchers.add(seq, grammar)

    def remove(self, request: Request[Any]) -> None:
        """The request registry's teardown hook: the request's sequences' matchers go."""
        group = request.group
        if self.matchers is not None and group.sampling_params.structured_outputs is not None:
            for seq in group.seqs:
                self.matchers.remove(seq)

    def fork_samples(self, forks: list[tuple[ScheduledSeq, list[Sequence]]]) -> None:
        """Each sample made from a completed prompt continues a copy of the prompt's matcher state."""
        if self.matchers is not None:
            for item, children in forks:
                for child in children:
                    self.matchers.fork(item.seq, child)

    def drop(self, seqs: list[Sequence]) -> None:
        """Samples that were never forked (their request ended first) drop their matchers."""
        if self.matchers is not None:
            for seq in seqs:
                self.matchers.remove(seq)

    def advance_beams(
        self,
        group: SequenceGroup,
        previous: list[Sequence],
        parents: list[Sequence],
        token_ids: list[int],
    ) -> None:
        """A beam search step of a constrained request: a beam forked from its parent continues a copy of
        the parent's grammar state (taken before the parent accepts its own token); every next beam
        (`group.seqs`, one per entry of `parents`) accepts its token; a beam of `previous` that no next beam
        continues (aborted by the step) drops its matcher. The tokens were drawn from masked logits, so
        each is one its grammar allows."""
        matchers = self.matchers
        if matchers is None or group.sampling_params.structured_outputs is None:
            return
        for beam, parent in zip(group.seqs, parents):
            if beam is not parent:
                matchers.fork(parent, beam)
        for beam, token in zip(group.seqs, token_ids):
            accepted = matchers.accept(beam, token)
            assert accepted, "a beam candidate outside its grammar"
        for beam in previous:
            if beam.status is SequenceStatus.FINISHED_ABORTED:
                matchers.remove(beam)

    def clear(self) -> None:
        """Every live request failed: every matcher goes (also those of samples not forked yet)."""
        if self.matchers is not None:
            self.matchers.clear()

    # ---- the step -----------------------------------------------------------------------------

    def acceptor(self) -> Callable[[Sequence, int], bool] | None:
        """What advances a sequence's matcher with its sampled token (None while no sequence is
        constrained: every token is accepted)."""
        return self.matchers.accept if self.matchers else None

    def constrained_rows(self, seqs: list[Sequence]) -> list[int]:
        return self.matchers.constrained_rows(seqs) if self.matchers is not None else []

    def draft_bitmask(self, items: list[ScheduledSeq], device: torch.device) -> TokenBitmask | None:
        return self.matchers.draft_bitmask(items, device) if self.matchers else None

    def bitmask(
        self, seqs: list[Sequence], rows: list[int], device: torch.device, *, own_buffer: bool = False
    ) -> TokenBitmask | None:
        if self.matchers is None or not rows:
            return None
        return self.matchers.bitmask(seqs, rows, device, own_buffer=own_buffer)


def _walk_drafts(matcher: xgr.GrammarMatcher, drafts: list[int], mask: torch.Tensor, first: int) -> None:
    """Fills rows first .. first + len(drafts) of `mask`: each after the drafts before it. From a draft the
    grammar refuses (or one that ends it) on, the rows repeat the last mask: that draft cannot be kept, so
    the rows after it are never read. The matcher ends where it began."""
    walked = 0
    for j in range(len(drafts) + 1):
        if j == walked and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask, first + j)
            if j < len(drafts) and matcher.accept_token(drafts[j]):
                walked += 1
        else:
            mask[first + j] = mask[first + j - 1]
    if walked:
        matcher.rollback(walked)


def _escape_regex(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)
