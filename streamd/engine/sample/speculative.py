"""Verification of draft tokens (speculative decoding): which drafts a step keeps, and the token after them.

A decode with k drafts (`ScheduledSeq.draft`, proposed by `engine/core/speculation.py`) gets k + 1 logits
rows from the forward: row j is the model's distribution after draft j (row 0: after the sequence's own last
token). Draft j + 1 is checked against row j, in order, and the first refusal ends the run:

- greedy rows keep a draft when it is the row's argmax, and otherwise take the argmax: exactly the tokens
  decoding one at a time would give;
- sampled rows use the standard rejection rule for a draft proposed with certainty (prompt lookup, a
  prediction and the greedy draft model propose one token, q = 1 on it): keep draft d with probability
  p(d), else draw from p with d removed (the residual max(p - q, 0), renormalized). Each kept or drawn token
  is therefore distributed exactly as p, the distribution sampling alone would use (temperature,
  top-k/top-p, min-p, logit_bias and a structured output's grammar mask applied as usual).

When every draft is kept, the last row gives one more token. All rows are decided on the device at once;
the host receives, per row, whether its draft was kept, the row's own token, and (when asked) logprobs of
both, in one transfer, and walks each run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamd.engine.core.scheduler_output import ScheduledSeq
from streamd.engine.sample.grammar import TokenBitmask
from streamd.engine.sample.sampler import Sampler
from streamd.engine.sampling_params import SamplingParams
from streamd.engine.worker.host_to_device import to_device


@dataclass(slots=True)
class Verified:
    """A speculative step's outcome per item: the tokens it keeps (accepted drafts, then the model's own),
    how many drafts were accepted, and the kept tokens' logprobs when any item asked."""

    token_ids: list[list[int]]
    accepted: list[int]
    logprobs: list[list[dict[int, float]]] | None


@dataclass(slots=True)
class PendingVerify:
    """The items with drafts of a launched step and their per-row results on the way to the host."""

    items: list[ScheduledSeq]
    payload: torch.Tensor  # float64 [rows, 2 + 2 (+ 2 top_n)]: kept?, own token, logprobs (draft, own, top)
    top_n: int

    def result(self) -> Verified:
        rows = self.payload.tolist()
        tokens, accepted, logprobs = [], [], []
        want = self.top_n >= 0
        row = 0
        for item in self.items:
            assert item.draft is not None
            run, lps = _walk(rows, row, item.draft.token_ids, item.group.sampling_params, self.top_n)
            tokens.append(run)
            accepted.append(len(run) - 1)
            logprobs.append(lps)
            row += len(item.draft.token_ids) + 1
        return Verified(tokens, accepted, logprobs if want else None)


def verify(
    sampler: Sampler, logits: torch.Tensor, items: list[ScheduledSeq], bitmask: TokenBitmask | None = None
) -> PendingVerify:
    """Queues the verification of `items`' drafts; `logits` holds their rows, item after item; `bitmask`
    gates the rows of constrained items (`GrammarMatchers.draft_bitmask`), as sampling gates theirs."""
    dev = logits.device
    if logits.shape[1] > sampler.vocab_size:
        logits = logits[:, : sampler.vocab_size]
    seqs, params, drafts = [], [], []
    for item in items:
        assert item.draft is not None
        count = len(item.draft.token_ids) + 1
        seqs += [item.seq] * count
        params += [item.group.sampling_params] * count
        drafts += [*item.draft.token_ids, -1]  # the last row has no draft to check
    draft = to_device(drafts, torch.int64, dev)
    x = sampler.penalize(logits, seqs, params)  # (context-free parts only: logit_bias)
    if bitmask is not None:  # (logprobs stay the raw distribution's, as in sampling)
        x = bitmask.apply(x.clone() if x is logits else x.contiguous())
    own = x.argmax(dim=-1)
    kept = own == draft
    if not all(p.greedy for p in params):
        kept, own = _rejection(sampler, x, params, draft, kept, own)
    parts = [kept.double().unsqueeze(1), own.double().unsqueeze(1)]
    top_n = max((p.logprobs if p.logprobs is not None else -1) for p in params)
    if top_n >= 0:
        parts += _logprob_columns(logits, draft, own, top_n)
    return PendingVerify(items, torch.cat(parts, dim=1), top_n)


def _rejection(
    sampler: Sampler,
    x: torch.Tensor,
    params: list[SamplingParams],
    draft: torch.Tensor,
    kept: torch.Tensor,
    own: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rejection rule on the sampled rows (greedy rows keep their argmax test)."""
    rows = [i for i, p in enumerate(params) if not p.greedy]
    index = to_device(rows, torch.int64, x.device)
    chosen = [params[i] for i in rows]
    probs = sampler.distribution(x.index_select(0, index), chosen, list({id(p): p for p in chosen}.values()))
    row_draft = draft.index_select(0, index)
    has_draft = row_draft >= 0
    safe = row_draft.clamp(min=0).unsqueeze(1)
    p_draft = probs.gather(1, safe).squeeze(1)
    residual = probs.scatter(1, safe, torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
    token, uniform = sampler.draw(residual)
    accept = has_draft & (uniform < p_draft)
    return kept.index_copy(0, index, accept), own.index_copy(0, index, token)


def _logprob_columns(logits: torch.Tensor, draft: torch.Tensor, own: torch.Tensor, top_n: int) -> list[torch.Tensor]:
    """Each row's raw logprob of its draft and of its own token, and its top `top_n` (ids, logprobs)."""
    raw = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    cols = [
        raw.gather(1, draft.clamp(min=0).unsqueeze(1)).double(),
        raw.gather(1, own.unsqueeze(1)).double(),
    ]
    if top_n:
        top = raw.topk(min(top_n, raw.shape[1]), dim=-1)
        cols += [top.indices.double(), top.values.double()]
    return cols


def _walk(
    rows: list[list[float]], first: int, draft: list[int], params: SamplingParams, top_n: int
) -> tuple[list[int], list[dict[int, float]]]:
    """One item's kept tokens (drafts while kept, then the first refusing row's own token, or the last
    row's) and their logprobs (when its request asked)."""
    run: list[int] = []
    logprobs: list[dict[int, float]] = []
    for j in range(len(draft) + 1):
        row = rows[first + j]
        take_draft = j < len(draft) and row[0] > 0.5
        token = draft[j] if take_draft else int(row[1])
        run.append(token)
        if params.logprobs is not None:
            logprobs.append(_entry(row, token, row[2] if take_draft else row[3], params.logprobs, top_n))
        if not take_draft:
            break
    return run, logprobs


def _entry(row: list[float], token: int, logprob: float, k: int, top_n: int) -> dict[int, float]:
    width = min(k, top_n)
    entry = {int(t): v for t, v in zip(row[4 : 4 + width], row[4 + top_n : 4 + top_n + width])}
    entry.setdefault(token, logprob)
    return entry
