"""The draft model of speculative decoding (`speculative.draft_model`): a smaller model with the target's
tokenizer proposes the next k tokens of a sequence greedily, and the target verifies them in one forward
(`engine/sample/speculative.py`). It implements the core's `DraftSource` (`engine/core/speculation.py`), which
decides when it is asked; the builder injects it.

Why it looks as it does:
- The draft runs through transformers' own attention with one `DynamicCache` per sequence, not through the
  paged pool: it is small, it drafts for at most `speculative.disable_by_batch_size` sequences a step, and its
  cache must roll back to the tokens the target kept, which a per-sequence cache does by cropping.
- The cache is cropped lazily: each `propose` compares the tokens its cache holds with the sequence's tokens
  now and drops the rejected tail (the target's verdict needs no hook of its own). The token ids a cache holds
  are recorded with it, so it never serves KV of tokens the sequence no longer has.
- Caches are per sequence and go when the scheduler says the sequence ended or was preempted (`forget`);
  at most `max_sequences` are kept, least recently used dropped first (a dropped one is rebuilt from the
  tokens on the next `propose`), so sequences that stopped drafting (a batch too large) hold no memory for long.
- Greedy drafts are a deterministic function of the tokens, so the rejection rule for a draft proposed with
  certainty (the verify step's) keeps sampled output distributed exactly as without speculation.
- A draft whose tokenizer is not the target's would propose ids meaning other text: refused at load, naming
  `speculative.draft_model`. Where both tokenizers are known their vocabularies must be equal (the models'
  embedding sizes may differ by padding; a draft id the target has not is never proposed); random-weight
  models without a tokenizer must have equal vocabulary sizes.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from streamd.config import Config, ConfigError
from streamd.engine.worker.model_loader import LoadedModel, load_model, resolve_dtype
from streamd.engine.worker.model_runner import kv_layout_of
from streamd.logs import get_logger

log = get_logger(__name__)


@dataclass(slots=True)
class DraftKV:
    """One sequence's draft cache: the KV of exactly `cached_ids`, and how many of them were the sequence's own
    when it was last asked (the rest were drafts, which the target may have refused)."""

    cache: DynamicCache
    cached_ids: list[int]
    confirmed: int = 0


class DraftModel:
    """Greedy drafts from a small model, one cache per sequence (`DraftSource`)."""

    def __init__(self, model: PreTrainedModel, target_vocab_size: int, max_len: int, max_sequences: int) -> None:
        """`target_vocab_size`: ids from it on are never proposed; `max_len`: the draft's context; at most
        `max_sequences` caches are kept."""
        self.model = model
        self.device = next(model.parameters()).device
        self.target_vocab_size = target_vocab_size
        self.max_len = max_len
        self.max_sequences = max_sequences
        # transformers renamed `past_key_values` to `cache` (the old name warns); either, as the model takes it
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._caches: OrderedDict[int, DraftKV] = OrderedDict()  # seq_id -> its cache, least recently used first

    @property
    def cached_sequences(self) -> list[int]:
        """The sequences that hold a draft cache now."""
        return list(self._caches)

    def max_cache_bytes(self) -> int:
        """The most its caches hold: `max_sequences` of `max_len` tokens (the KV pool is sized around it), each
        sequence's cache laid out as one block of the paged pool's layout would be."""
        dtype = next(self.model.parameters()).dtype
        return self.max_sequences * kv_layout_of(self.model, self.max_len, dtype).bytes_per_block

    @torch.inference_mode()
    def propose(self, seq_id: int, token_ids: list[int], limit: int) -> list[int]:
        """Up to `limit` greedy tokens after `token_ids`, cut before the first id the target has not."""
        limit = min(limit, self.max_len - len(token_ids))
        if limit <= 0:
            return []
        kv = self._cache_of(seq_id, token_ids)
        drafts = self._continue(kv, token_ids[len(kv.cached_ids) :], limit)
        kv.cached_ids = token_ids + drafts[:-1]  # (the last draft was never fed)
        kv.confirmed = len(token_ids)
        valid = next((i for i, t in enumerate(drafts) if t >= self.target_vocab_size), len(drafts))
        return drafts[:valid]

    def forget(self, seq_id: int) -> None:
        self._caches.pop(seq_id, None)

    def _cache_of(self, seq_id: int, token_ids: list[int]) -> DraftKV:
        """`seq_id`'s cache, cropped to the tokens it shares with `token_ids` (less one: the last token is fed
        again for its logits), or a new one; the most recently used from now on."""
        kv = self._caches.pop(seq_id, None) or DraftKV(DynamicCache(), [])
        self._caches[seq_id] = kv
        while len(self._caches) > self.max_sequences:
            self._caches.popitem(last=False)
        keep = min(_common_prefix(kv.cached_ids, token_ids, kv.confirmed), len(token_ids) - 1)
        if keep < len(kv.cached_ids):
            kv.cache.crop(keep - len(kv.cached_ids))  # (a negative count: the tokens to remove)
            del kv.cached_ids[keep:]
        return kv

    def _continue(self, kv: DraftKV, new_ids: list[int], limit: int) -> list[int]:
        """Feeds `new_ids` into `kv`'s cache, then `limit` greedy tokens one at a time (all but the last fed);
        one transfer to the host at the end."""
        ids = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        drafted: list[torch.Tensor] = []
        for step in range(limit):
            if step:
                ids = drafted[-1]
            cache = {self._cache_argument: kv.cache}
            logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache).logits
            drafted.append(logits[:, -1].argmax(dim=-1, keepdim=True))
        return torch.cat(drafted, dim=1)[0].tolist()


def _common_prefix(cached: list[int], token_ids: list[int], confirmed: int) -> int:
    """How many leading tokens `cached` and `token_ids` share; the first `confirmed` are checked in one
    comparison (they were the sequence's own: they still are, unless it was rolled back), the rest one by one
    (at most the drafts of one step)."""
    end = min(len(cached), len(token_ids))
    n = min(confirmed, end)
    if cached[:n] != token_ids[:n]:
        n = 0
    while n < end and cached[n] == token_ids[n]:
        n += 1
    return n


def load_draft_model(config: Config, target: LoadedModel, device: torch.device, max_model_len: int) -> DraftModel:
    """`speculative.draft_model` on the target's device, in `model.dtype`, loaded as the target is (the same
    loader and its conventions); refused when its tokenizer is not the target's."""
    spec, model_cfg = config.speculative, config.model
    dtype = resolve_dtype(model_cfg.dtype, device)
    low_bit = (model_cfg.quantization, model_cfg.low_bit_matmul)
    draft = load_model(spec.draft_model, dtype, device, model_cfg.cache_dir, model_cfg.seed, *low_bit)
    target_vocab = target.model.config.get_text_config().vocab_size
    check_compatible(spec.draft_model, draft, target_vocab, target.tokenizer)
    context = getattr(draft.model.config.get_text_config(), "max_position_embeddings", None) or max_model_len
    log.info("draft_model.loaded", draft=draft.name, target_vocab=target_vocab, context=min(context, max_model_len))
    return DraftModel(draft.model, target_vocab, min(context, max_model_len), 2 * spec.disable_by_batch_size)


def check_compatible(name: str, draft: LoadedModel, target_vocab_size: int, target_tokenizer: Any | None) -> None:
    """Raises ConfigError naming `speculative.draft_model` when the draft's tokens are not the target's."""
    draft_vocab = draft.model.config.get_text_config().vocab_size
    if draft.tokenizer is not None and target_tokenizer is not None:
        ours, theirs = draft.tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if ours != theirs:
            raise ConfigError(
                f"speculative.draft_model {name!r} has another tokenizer than model.name ({len(ours)} tokens "
                f"against {len(theirs)}, {len(ours.items() ^ theirs.items())} entries differ): a draft model must "
                "share the target's tokenizer"
            )
    elif draft_vocab != target_vocab_size:
        raise ConfigError(
            f"speculative.draft_model {name!r} has a vocabulary of {draft_vocab} tokens, model.name one of "
            f"{target_vocab_size}: a draft model must share the target's tokenizer"
        )
