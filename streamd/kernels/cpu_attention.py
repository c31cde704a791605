"""Paged attention on the CPU, planned once per step: the index arithmetic every layer would repeat is done once.

On a GPU a kernel launch does the paging; on the CPU the references (`reference.py`) do it in torch ops, and
for a decode step most of their ~25 operators per layer (table slicing, position masks, the padded-entry
fix-up, masking NaN out of stale slots) depend only on the step's block tables and lengths, identical for
all of the model's layers. A `DecodePlan` computes them once (`plan_decode`); each layer then does one gather
of its keys and values and one SDPA call. `StorePlan` does the same for the K/V store.

Both address the pool as rows of `head_dim` values (`PoolRows`): a pool block [layers, 2, kv_heads, block_size,
head_dim] is rows in that order, so (block, layer, k|v, head, offset) is one row number, and layer l's rows are
layer 0's plus l x (2 x kv_heads x block_size). A layer's whole context is then one `index_select` of
contiguous rows into [2, S, kv_heads, T, head_dim], already the layout SDPA reads (advanced indexing over
(block, offset) cost ~5x as much: benchmarks/NOTES.md, "Issue 25, one stream"), and its store one
`index_copy_`. An 8-bit pool's scales are addressed by the same row numbers (their block is [layers, 2, kv_heads,
block_size]).

Padded positions (a shorter sequence in a batch) gather the sequence's own first slot, which always holds a
written key, so the masked-out scores multiply finite values: no NaN from stale slots, and no `masked_fill`.
Same arithmetic as `reference.paged_decode_attention` for layers without extras (no window, soft cap or
sinks; those take the reference); tests compare the two. An 8-bit pool (`kv_scales` given) is quantized on store
and its gathered rows dequantized to the query's dtype (`layout.quantize_rows`, the kernels' reference).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamd.kernels.layout import dequantize_rows, quantize_rows


@dataclass(frozen=True, slots=True)
class PoolRows:
    """One pool (and its 8-bit scales) as rows: `codes` [rows, head_dim], `scales` [rows] or None; block b's row
    r is row b x `block_rows` + r of `codes` and b x `scale_rows` + r of `scales`. Float8 codes are moved as
    their bytes (`index_copy_` and `index_select` have no float8 kernels on the CPU)."""

    codes: torch.Tensor  # the pool's dtype, or uint8 for a float8 pool
    dtype: torch.dtype  # the pool's
    block_rows: int
    scales: torch.Tensor | None
    scale_rows: int
    kv_heads: int
    page: int  # the block size (tokens)
    head_dim: int

    @property
    def layer_rows(self) -> int:
        """Rows of one layer in a block: 2 x kv_heads x block_size."""
        return 2 * self.kv_heads * self.page

    def rows(self, blocks: torch.Tensor, within: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer 0's row numbers of (block, row within the block) in `codes` and in `scales`."""
        scale_rows = None if self.scales is None else blocks * self.scale_rows + within
        return blocks * self.block_rows + within, scale_rows


def pool_rows(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> PoolRows:
    """`kv_cache` [num_blocks, layers, 2, kv_heads, block_size, head_dim] (and `kv_scales`, the same less
    head_dim) as rows, without a copy. A block's rows must be contiguous and start on a row (the pool's
    allocation keeps them so: `KVLayout.bytes_per_block`)."""
    codes, block_rows = _as_rows(kv_cache, kv_cache.shape[-1])
    scales, scale_rows = (None, 0) if kv_scales is None else _as_rows(kv_scales, 1)
    _, _, _, heads, page, head_dim = kv_cache.shape
    if kv_cache.dtype.is_floating_point and kv_cache.element_size() == 1:
        codes = codes.view(torch.uint8)
    flat = None if scales is None else scales.view(-1)
    return PoolRows(codes, kv_cache.dtype, block_rows, flat, scale_rows, heads, page, head_dim)


def _as_rows(pool: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    per_block = math.prod(pool.shape[1:])
    inner = pool[0] if pool.shape[0] else pool
    if not inner.is_contiguous() or pool.stride(0) % width or (pool.shape[0] > 1 and pool.stride(0) < per_block):
        raise ValueError(f"a KV pool's blocks must be contiguous rows of {width} values, got strides {pool.stride()}")
    block_rows = pool.stride(0) // width
    rows = (pool.shape[0] - 1) * block_rows + per_block // width if pool.shape[0] else 0
    return pool.as_strided((rows, width), (width, 1)), block_rows


def _within(heads: int, page: int, kv: torch.Tensor, head: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The row within a block of layer 0's (k|v, head, offset)."""
    return (kv * heads + head) * page + offsets


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """Where each sequence's context lives in layer 0 of the pool, for one decode step."""

    pool: PoolRows
    rows: torch.Tensor  # int64 [2 * S * kv_heads * T]: k|v, sequence, head, position t (padded: its position 0's)
    scale_rows: torch.Tensor | None
    shape: tuple[int, int, int, int]  # (S, kv_heads, T, head_dim)
    mask: torch.Tensor | None  # bool [S, 1, 1, T]: True where t < seq_len (None when all lengths are equal)


@dataclass(frozen=True, slots=True)
class StorePlan:
    pool: PoolRows
    keep: torch.Tensor | None  # bool [tokens]: slot >= 0 (None: every token is stored)
    rows: torch.Tensor  # int64 [2 * stored * kv_heads]: layer 0's rows of k|v, token, head
    scale_rows: torch.Tensor | None


def plan_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, pool: PoolRows) -> DecodePlan:
    heads, page, head_dim = pool.kv_heads, pool.page, pool.head_dim
    lens = seq_lens.to(torch.long)
    context = max(1, int(lens.max()))
    positions = torch.arange(context)[None, :].expand(lens.shape[0], -1)
    valid = positions < lens[:, None]
    positions = torch.where(valid, positions, 0)  # padding reads position 0 (always written)
    blocks = block_tables.to(torch.long).gather(1, positions // page)  # [S, T]
    kv, head = torch.arange(2)[:, None, None, None], torch.arange(heads)[None, None, :, None]
    within = _within(heads, page, kv, head, (positions % page)[None, :, None, :])  # [2, S, H, T]
    rows, scale_rows = pool.rows(blocks[None, :, None, :], within)
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    flat = None if scale_rows is None else scale_rows.reshape(-1)
    return DecodePlan(pool, rows.reshape(-1), flat, (lens.shape[0], heads, context, head_dim), mask)


def plan_store(slot_mapping: torch.Tensor, pool: PoolRows) -> StorePlan:
    heads, page = pool.kv_heads, pool.page
    slots = slot_mapping.to(torch.long)
    stored = slots >= 0
    keep = None if bool(stored.all()) else stored
    if keep is not None:
        slots = slots[keep]
    kv, head = torch.arange(2)[:, None, None], torch.arange(heads)[None, None, :]
    within = _within(heads, page, kv, head, (slots % page)[None, :, None])  # [2, tokens, H]
    rows, scale_rows = pool.rows((slots // page)[None, :, None], within)
    return StorePlan(pool, keep, rows.reshape(-1), None if scale_rows is None else scale_rows.reshape(-1))


def store_kv(key: torch.Tensor, value: torch.Tensor, layer: int, plan: StorePlan) -> None:
    """Writes token t's key/value [tokens, kv_heads, head_dim] where the plan's slot t says (8-bit codes and
    their scales on an 8-bit pool)."""
    pool, step = plan.pool, layer * plan.pool.layer_rows
    rows = torch.stack((key, value)) if plan.keep is None else torch.stack((key[plan.keep], value[plan.keep]))
    rows = rows.view(-1, rows.shape[-1])
    if pool.scales is None:
        pool.codes.index_copy_(0, plan.rows + step, rows.to(pool.dtype))
        return
    assert plan.scale_rows is not None
    codes, scales = quantize_rows(rows, pool.dtype)
    pool.codes.index_copy_(0, plan.rows + step, codes.view(pool.codes.dtype))
    pool.scales.index_copy_(0, plan.scale_rows + step, scales)


def decode_attention(query: torch.Tensor, layer: int, plan: DecodePlan, scale: float) -> torch.Tensor:
    """query [S, heads, head_dim] over each sequence's context in `layer`: [S, heads, head_dim]."""
    num_seqs, num_heads, head_dim = query.shape
    pool, step = plan.pool, layer * plan.pool.layer_rows
    kv = pool.codes.index_select(0, plan.rows + step).view(pool.dtype).view(2, *plan.shape)  # [2, S, kv_heads, T, D]
    if pool.scales is not None:
        assert plan.scale_rows is not None
        scales = pool.scales.index_select(0, plan.scale_rows + step).view(2, *plan.shape[:3])
        kv = dequantize_rows(kv, scales, query.dtype)
    num_kv_heads = plan.shape[1]
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).to(kv.dtype)
    out = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=plan.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)
