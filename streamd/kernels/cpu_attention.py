"""Paged attention on the CPU, planned once per step: the index arithmetic every layer would repeat is done once.

On a GPU a kernel launch does the paging; on the CPU the references (`reference.py`) do it in torch ops, and
for a decode step most of their ~25 operators per layer (table slicing, position masks, the padded-entry
fix-up, masking NaN out of stale slots) depend only on the step's block tables and lengths, identical for
all of the model's layers. A `DecodePlan` computes them once (`plan_decode`); each layer then does two
gathers and one SDPA call. `StorePlan` does the same for the K/V store (`slot_mapping` split into block and
offset once).

Padded positions (a shorter sequence in a batch) gather the sequence's own first slot, which always holds a
written key, so the masked-out scores multiply finite values: no NaN from stale slots, and no `masked_fill`.
Same arithmetic as `reference.paged_decode_attention` for layers without extras (no window, soft cap or
sinks; those take the reference); tests compare the two. An 8-bit pool (`kv_scales` given) is quantized on store
and its gathered rows dequantized to the query's dtype (`layout.quantize_rows`, the kernels' reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamd.kernels.layout import dequantize_rows, write_kv_rows


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Where each sequence's context lives in a layer of the pool, for one decode step."""

    blocks: torch.Tensor  # int64 [S, T]: the block of position t of sequence s (padded: its position 0's)
    offsets: torch.Tensor  # int64 [S, T]: the offset within that block
    mask: torch.Tensor | None  # bool [S, 1, 1, T]: True where t < seq_len (None when all lengths are equal)


@dataclass(frozen=True, slots=True)
class StorePlan:
    keep: torch.Tensor | None  # bool [tokens]: slot >= 0 (None: every token is stored)
    blocks: torch.Tensor  # int64 [stored]
    offsets: torch.Tensor  # int64 [stored]


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, page: int) -> DecodePlan:
    lens = seq_lens.to(torch.long)
    context = max(1, int(lens.max()))
    positions = torch.arange(context)[None, :].expand(lens.shape[0], -1)
    valid = positions < lens[:, None]
    positions = torch.where(valid, positions, 0)  # padding reads position 0 (always written)
    blocks = block_tables.to(torch.long).gather(1, positions // page)
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    return DecodePlan(blocks, positions % page, mask)


def plan_store(slot_mapping: torch.Tensor, page: int) -> StorePlan:
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    if bool(keep.all()):
        return StorePlan(None, slots // page, slots % page)
    slots = slots[keep]
    return StorePlan(keep, slots // page, slots % page)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    plan: StorePlan,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Writes token t's key/value [tokens, kv_heads, head_dim] where the plan's slot t says (8-bit codes and
    their scales with `kv_scales`)."""
    kv = kv_cache[:, layer]
    if plan.keep is not None:
        key, value = key[plan.keep], value[plan.keep]
    scales = None if kv_scales is None else kv_scales[:, layer]
    write_kv_rows(kv, scales, plan.blocks, plan.offsets, key, value)


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    plan: DecodePlan,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """query [S, heads, head_dim] over each sequence's context in `layer`: [S, heads, head_dim]."""
    num_seqs, num_heads, head_dim = query.shape
    kv = kv_cache[:, layer]
    num_kv_heads = kv.shape[2]
    # [S, T] indices into (block, offset) pick [S, T, kv_heads, head_dim]; SDPA wants heads before T.
    k = kv[plan.blocks, 0, :, plan.offsets]
    v = kv[plan.blocks, 1, :, plan.offsets]
    if kv_scales is not None:
        scales = kv_scales[:, layer]
        k = dequantize_rows(k, scales[plan.blocks, 0, :, plan.offsets], query.dtype)
        v = dequantize_rows(v, scales[plan.blocks, 1, :, plan.offsets], query.dtype)
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(k.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
