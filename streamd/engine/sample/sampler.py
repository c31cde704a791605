"""Sampler: picks the next token of every sampling row of a batch, vectorized over the batch.

Owns the logits -> token step: repetition / frequency / presence penalties, logit_bias, min_tokens masking, greedy,
temperature, min-p, top-k, top-p, per-request seeds and logprobs. Everything runs on the logits' device;
the only device -> host transfer is one `.tolist()` of the results per call.

Order of processing (as vLLM): penalties -> logit_bias -> min_tokens mask -> grammar bitmask -> [greedy rows: argmax] ->
temperature -> min-p -> top-k -> top-p -> sample. Logprobs are those of the model's raw distribution (log_softmax of the
unprocessed logits).

Sampling uses the exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. draws a token with probability
proportional to probs. Seeded rows draw their q from a generator seeded by (seed, sample index, output
position), so a seeded row's token depends only on its own logits and those three numbers: the same whatever
else is in the batch, and the same again after a preemption that recomputes the sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from streamd.engine.core.sequence import Sequence
from streamd.engine.sample.grammar import TokenBitmask
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.worker.host_to_device import to_device

_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # One {token_id: logprob} per row when any row asked for logprobs (rows that did not: {}), else None.
    logprobs: list[dict[int, float]] | None = None


class Sampler:
    """Callable once per step with the logits of the rows that sample."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int], seed: int | None = None) -> None:
        # Columns past vocab_size (padded embedding tables) are never sampled.
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        # Unseeded rows draw from this generator when an engine seed is given, else torch's default one.
        self._seed = seed
        self._generator: torch.Generator | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        params: list[SamplingParams],
        bitmask: TokenBitmask | None = None,
    ) -> SamplerOutput:
        return self.sample_async(logits, seqs, params, bitmask).result()

    def sample_async(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        params: list[SamplingParams],
        bitmask: TokenBitmask | None = None,
        *,
        owns_logits: bool = False,
    ) -> PendingSample:
        """Queues the sampling and the device -> host copy of its results without waiting for them; the
        chosen tokens stay usable on the device (as the next step's inputs) before the host has them.
        `owns_logits`: the caller hands `logits` over (the engine's fresh model output), so the grammar
        bitmask is applied to it in place rather than to a copy (a copy of the batch's logits costs more
        than the grammar work at batch 256 on the CPU)."""
        n = logits.shape[0]
        if len(seqs) != n or len(params) != n:
            raise ValueError(f"sampler got {n} logit rows for {len(seqs)} seqs and {len(params)} params")
        if n == 0:
            empty = torch.empty(0, dtype=torch.int64, device=logits.device)
            return PendingSample(empty, empty, params, 0)
        if logits.shape[1] > self.vocab_size:
            logits = logits[:, : self.vocab_size]
        # Rows share SamplingParams objects (n > 1, one params for many prompts): decide per object, so
        # the common case costs one pass over a handful of objects, not work per row.
        distinct = list({id(p): p for p in params}.values())
        want_logprobs = any(p.logprobs is not None for p in distinct)
        raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32) if want_logprobs else None

        x = self.penalize(logits, seqs, params, distinct)
        if bitmask is not None:  # grammar: disallowed tokens of constrained rows -> -inf, one batched call
            x = bitmask.apply(x.clone() if x is logits and not owns_logits else x)
        random_params = [p for p in distinct if not p.greedy]
        if not random_params:
            tokens = x.argmax(dim=-1)
        elif len(random_params) == len(distinct):
            tokens = self._sample(x, seqs, params, random_params)
        else:  # greedy rows take the argmax; only the others go through temperature, top-k/top-p and the draw
            rows = [i for i, p in enumerate(params) if not p.greedy]
            index = to_device(rows, torch.long, x.device)
            sampled = self._sample(
                x.index_select(0, index), [seqs[i] for i in rows], [params[i] for i in rows], random_params
            )
            tokens = x.argmax(dim=-1).index_copy_(0, index, sampled)

        if raw_logprobs is None:
            return PendingSample(tokens, tokens, params, 0)
        return self._with_logprobs(tokens, raw_logprobs, params, distinct)

    # ---- penalties and masks -------------------------------------------------------------------

    def penalize(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        params: list[SamplingParams],
        distinct: list[SamplingParams] | None = None,
    ) -> torch.Tensor:
        """Penalties and min_tokens masking; returns `logits` itself when no row uses them. Out-of-place
        throughout: the caller's logits are never modified."""
        if distinct is None:
            distinct = list({id(p): p for p in params}.values())
        x = logits
        use_rep = any(p.repetition_penalty != 1.0 for p in distinct)
        use_freq = any(p.frequency_penalty for p in distinct)
        use_pres = any(p.presence_penalty for p in distinct)
        if use_rep or use_freq or use_pres:
            x = x.float()
            n, vocab = x.shape
            dev = x.device
            # Per-row histogram of output tokens (OpenAI penalties count output tokens only).
            outputs = [s.output_token_ids if p.uses_penalties else [] for s, p in zip(seqs, params)]
            counts = self._histogram(outputs, n, vocab, dev)
            if use_rep:
                # HF/vLLM repetition penalty: any token seen in prompt or output; positive logits are
                # divided, negative multiplied, so the token always becomes less likely.
                prompts = [s.prompt_token_ids if p.repetition_penalty != 1.0 else [] for s, p in zip(seqs, params)]
                seen = (counts > 0) | (self._histogram(prompts, n, vocab, dev) > 0)
                r = self._column([p.repetition_penalty for p in params], dev)
                x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
            if use_freq:
                x = x - self._column([p.frequency_penalty for p in params], dev) * counts
            if use_pres:
                x = x - self._column([p.presence_penalty for p in params], dev) * (counts > 0).float()

        if any(p.logit_bias for p in distinct):
            x = self._biased(x, params)
        if any(p.thinking_token_budget is not None for p in distinct):
            x = self._force_thinking_end(x, seqs, params)
        if any(p.min_tokens for p in distinct):
            rows: list[int] = []
            cols: list[int] = []
            vocab = x.shape[1]
            for i, (s, p) in enumerate(zip(seqs, params)):
                if p.min_tokens and s.num_output_tokens < p.min_tokens:
                    # ignore_eos: EOS does not stop the sequence, so it need not be masked.
                    stops = set(p.stop_token_ids)
                    if not p.ignore_eos:
                        stops.update(self.eos_token_ids)
                    for t in stops:
                        if t < vocab:
                            rows.append(i)
                            cols.append(t)
            if rows:
                dev = x.device
                index = (to_device(rows, torch.long, dev), to_device(cols, torch.long, dev))
                # torch.full, not torch.tensor(scalar, device=...): the latter is a blocking host copy.
                x = x.index_put(index, torch.full((1,), float("-inf"), dtype=x.dtype, device=dev))
        return x

    @staticmethod
    def _biased(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Adds each row's `logit_bias` (token ids within the vocabulary: checked on admission) out of place."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, p in enumerate(params):
            for token, bias in (p.logit_bias or {}).items():
                rows.append(i)
                cols.append(token)
                values.append(bias)
        dev = x.device
        index = (to_device(rows, torch.long, dev), to_device(cols, torch.long, dev))
        return x.float().index_put(index, to_device(values, torch.float32, dev), accumulate=True)

    @staticmethod
    def _force_thinking_end(x: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
        """Rows whose reasoning ran out of budget may only take the next token of its closing sequence."""
        rows: list[int] = []
        cols: list[int] = []
        for i, (s, p) in enumerate(zip(seqs, params)):
            token = forced_thinking_token(s.output_token_ids, p)
            if token is not None:
                rows.append(i)
                cols.append(token)
        if not rows:
            return x
        dev = x.device
        index = to_device(rows, torch.long, dev)
        x = x.index_fill(0, index, float("-inf"))  # (whatever masked the token before: it is the only one)
        return x.index_put((index, to_device(cols, torch.long, dev)), torch.zeros(len(rows), dtype=x.dtype, device=dev))

    @staticmethod
    def _histogram(token_lists: list[list[int]], n: int, vocab: int, dev: torch.device) -> torch.Tensor:
        """[n, vocab] float counts of each row's tokens, built on the device from one padded id tensor."""
        width = max((len(t) for t in token_lists), default=0)
        counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=dev)
        if width == 0:
            return counts[:, :vocab]
        # Pad with the extra column `vocab`, which is dropped afterwards.
        padded = [t + [vocab] * (width - len(t)) for t in token_lists]
        ids = to_device(padded, torch.long, dev).clamp_(0, vocab)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=dev))
        return counts[:, :vocab]

    # ---- random sampling -----------------------------------------------------------------------

    def _sample(
        self, x: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams], distinct: list[SamplingParams]
    ) -> torch.Tensor:
        """Random sampling of rows none of which is greedy (`distinct`: their distinct params)."""
        dev = x.device
        probs = self.distribution(x, params, distinct)
        q = _exponential(torch.empty_like(probs), self._unseeded_generator(dev))
        if any(p.seed is not None for p in distinct):
            # Seeded rows: a fresh generator per row and step, keyed by (seed, sample, position) —
            # no state carried between steps, so batch composition and preemption cannot change it.
            for i, (s, p) in enumerate(zip(seqs, params)):
                if p.seed is not None:
                    gen = torch.Generator(device=dev)
                    gen.manual_seed(_mix(p.seed, s.sample_index, s.num_output_tokens))
                    _exponential(q[i], gen)
        return probs.div_(q).argmax(dim=-1)

    def draw(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row of `probs` (unnormalized is fine) by the exponential race, and a uniform draw
        per row (speculative decoding's acceptance test), from the engine's unseeded generator."""
        generator = self._unseeded_generator(probs.device)
        q = _exponential(torch.empty_like(probs), generator)
        uniform = torch.empty(probs.shape[0], dtype=torch.float32, device=probs.device).uniform_(generator=generator)
        return probs.div(q).argmax(dim=-1), uniform

    def distribution(
        self, x: torch.Tensor, params: list[SamplingParams], distinct: list[SamplingParams]
    ) -> torch.Tensor:
        """The probabilities non-greedy rows sample from: temperature, min-p, top-k, top-p, softmax."""
        dev = x.device
        x = x.float()
        # Temperature: a scalar when all rows agree (the common case), else a column.
        x = x / self._scalar_or_column(params, "temperature", distinct, dev)

        if any(p.min_p > 0 for p in distinct):
            # min-p: drop tokens less likely than min_p times the most likely one.
            probs = torch.softmax(x, dim=-1)
            min_p = self._scalar_or_column(params, "min_p", distinct, dev)
            x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))

        # Each row pays only for its own truncation: top-p alone needs a sort of the whole vocabulary,
        # top-k (with or without top-p) only torch.topk's k values, neither nothing.
        whole_vocab = [p for p in distinct if p.top_p < 1.0 and p.top_k <= 0]
        bounded = [p for p in distinct if p.top_k > 0]
        if whole_vocab:
            x = self._on_rows(x, params, whole_vocab, self._top_p_sorted)
        if bounded:
            x = self._on_rows(x, params, bounded, self._top_k_top_p_bounded)

        return torch.softmax(x, dim=-1)

    def _on_rows(
        self,
        x: torch.Tensor,
        params: list[SamplingParams],
        chosen: list[SamplingParams],
        transform: Callable[[torch.Tensor, list[SamplingParams], list[SamplingParams]], torch.Tensor],
    ) -> torch.Tensor:
        """`transform(rows, their params, their distinct params)` applied to the rows whose params are in
        `chosen` only; the whole batch at once when every row's are."""
        ids = {id(p) for p in chosen}
        if all(id(p) in ids for p in params):
            return transform(x, params, chosen)
        rows = [i for i, p in enumerate(params) if id(p) in ids]
        index = to_device(rows, torch.long, x.device)
        done = transform(x.index_select(0, index), [params[i] for i in rows], chosen)
        return x.index_copy(0, index, done)

    def _top_k_top_p_bounded(
        self, x: torch.Tensor, params: list[SamplingParams], distinct: list[SamplingParams]
    ) -> torch.Tensor:
        """Top-k, then top-p among the top k (rows that all have a top-k): works on torch.topk's max_k
        values (already sorted) instead of sorting the whole vocabulary, then masks below each row's
        threshold."""
        dev = x.device
        max_k = min(max(p.top_k for p in distinct), x.shape[1])
        top_values = x.topk(max_k, dim=-1).values  # descending
        ks = to_device([min(p.top_k, max_k) for p in params], torch.long, dev)
        keep = torch.arange(max_k, device=dev).unsqueeze(0) < ks.unsqueeze(1)
        if any(p.top_p < 1.0 for p in distinct):
            # Top-p among the top-k, renormalized: keep a token while the mass strictly above it is < p.
            probs = torch.softmax(top_values.masked_fill(~keep, float("-inf")), dim=-1)
            above = probs.cumsum(dim=-1) - probs
            keep &= above < self._scalar_or_column(params, "top_p", distinct, dev)
        last_kept = keep.sum(dim=-1, keepdim=True) - 1
        threshold = top_values.gather(1, last_kept.clamp_(min=0))
        return x.masked_fill(x < threshold, float("-inf"))

    def _top_p_sorted(
        self, x: torch.Tensor, params: list[SamplingParams], distinct: list[SamplingParams]
    ) -> torch.Tensor:
        """Top-p over the whole vocabulary (rows without top-k) on one ascending sort: masks the low tail
        whose total probability is at most 1-p (the top token always stays)."""
        sorted_x, order = x.sort(dim=-1)
        top_p = self._scalar_or_column(params, "top_p", distinct, x.device)
        cum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
        drop = cum <= 1.0 - top_p
        drop[:, -1] = False
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    def _unseeded_generator(self, dev: torch.device) -> torch.Generator | None:
        if self._seed is None:
            return None
        if self._generator is None or self._generator.device != dev:
            self._generator = torch.Generator(device=dev)
            self._generator.manual_seed(self._seed & _MASK64)
        return self._generator

    # ---- logprobs ------------------------------------------------------------------------------

    def _with_logprobs(
        self,
        tokens: torch.Tensor,
        raw_logprobs: torch.Tensor,
        params: list[SamplingParams],
        distinct: list[SamplingParams],
    ) -> PendingSample:
        """Top-N raw logprobs per row plus the sampled token's, moved to the host together with the
        tokens in ONE transfer (float64 holds token ids exactly)."""
        _n, vocab = raw_logprobs.shape
        top_n = min(max(p.logprobs or 0 for p in distinct), vocab)
        parts = [tokens.unsqueeze(1).double(), raw_logprobs.gather(1, tokens.unsqueeze(1)).double()]
        if top_n:
            top = raw_logprobs.topk(top_n, dim=-1)
            parts += [top.indices.double(), top.values.double()]
        return PendingSample(tokens, torch.cat(parts, dim=1), params, top_n)

    # ---- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _column(values: list[float], dev: torch.device) -> torch.Tensor:
        return to_device(values, torch.float32, dev).unsqueeze(1)

    @classmethod
    def _scalar_or_column(
        cls, params: list[SamplingParams], name: str, distinct: list[SamplingParams], dev: torch.device
    ) -> float | torch.Tensor:
        values = {getattr(p, name) for p in distinct}
        if len(values) == 1:
            return float(values.pop())
        return cls._column([float(getattr(p, name)) for p in params], dev)


def forced_thinking_token(output: list[int], params: SamplingParams) -> int | None:
    """The token a reply must take next to close its reasoning once `thinking_token_budget` output tokens
    were spent (the budget's end: `end[k]` after `k` closing tokens), or None: within budget, closed by the
    model itself before, or closed already. Scans the output only during the closing's few tokens."""
    budget, end = params.thinking_token_budget, params.thinking_end_token_ids
    if budget is None:
        return None
    forced = len(output) - budget
    if not 0 <= forced < len(end) or output[budget:] != end[:forced]:
        return None
    return None if _contains(output[: budget + forced], end) else end[forced]


def _contains(tokens: list[int], part: list[int]) -> bool:
    first, size = part[0], len(part)
    return any(tokens[i : i + size] == part for i, t in enumerate(tokens) if t == first)


def _exponential(q: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Fills `q` with Exp(1) draws, in place, strictly positive (a 0 would make 0/0 = NaN, which argmax
    would pick). CUDA: one exponential_ kernel. CPU: -log(U), U in [0, 1), about twice as fast as
    exponential_ there; U = 0 gives +inf, which only makes that token lose."""
    if q.device.type == "cpu":
        return q.uniform_(generator=generator).log_().neg_()
    return q.exponential_(generator=generator).clamp_min_(torch.finfo(q.dtype).tiny)


def _mix(seed: int, sample_index: int, position: int) -> int:
    """A 63-bit generator seed from (seed, sample index, output position), mixed by splitmix64 so nearby
    inputs give unrelated streams."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (sample_index & _MASK64))
    h = _splitmix64(h ^ (position & _MASK64))
    return h >> 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class PendingSample:
    """One step's sampled tokens, on the device now and on the host once `result()` returns."""

    tokens: torch.Tensor  # int64 [n] on the logits' device
    payload: torch.Tensor  # what travels to the host: the tokens, or float64 rows with their logprobs
    params: list[SamplingParams]
    top_n: int
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        if self.payload.is_cuda:  # start the copy now; result() only waits for it
            self.host = torch.empty(self.payload.shape, dtype=self.payload.dtype, pin_memory=True)
            self.host.copy_(self.payload, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> SamplerOutput:
        if self.event is not None:
            self.event.synchronize()  # the one device -> host wait of the step
        rows = (self.host if self.host is not None else self.payload).tolist()
        if self.payload.dim() == 1:
            return SamplerOutput(rows, None)
        return _decode_logprob_rows(rows, self.params, self.top_n)


def _decode_logprob_rows(rows: list[list[float]], params: list[SamplingParams], top_n: int) -> SamplerOutput:
    """Rows of [token, its logprob, top_n ids, top_n logprobs] back into tokens and {id: logprob} dicts."""
    token_ids: list[int] = []
    logprobs: list[dict[int, float]] = []
    for row, p in zip(rows, params):
        token = int(row[0])
        token_ids.append(token)
        if p.logprobs is None:
            logprobs.append({})
            continue
        k = min(p.logprobs, top_n)
        entry = {int(t): v for t, v in zip(row[2 : 2 + k], row[2 + top_n : 2 + top_n + k])}
        entry.setdefault(token, row[1])  # the sampled token's, whether or not it is in the top N
        logprobs.append(entry)
    return SamplerOutput(token_ids, logprobs)
