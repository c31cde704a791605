"""Paged attention plugged into transformers models, and the per-step attention metadata it reads.

The ModelRunner sets one `AttentionMetadata` per forward (the only global mutable state in streamd: the
model's layers call the attention function without a way to pass it through). `paged_attention_forward`
is registered with transformers' `AttentionInterface` under the name "streamd"; it stores the new K/V
into the paged pool and attends over the block tables. No mask function is registered under that name,
so transformers skips mask construction entirely (the causal structure lives in the kernels).

The per-layer extras transformers passes with the call reach the kernels as `LayerExtras`: a layer's
``sliding_window`` (Mistral, Gemma 2/3, gpt-oss, Qwen2's windowed layers; None on full-attention layers),
Gemma 2's logit ``softcap`` and gpt-oss's sinks (``s_aux``, one logit per query head). Their semantics
are the references' (`streamd.kernels.reference`), which are transformers' masks and eager softmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, cast

import torch
from transformers import AttentionInterface

from streamd.kernels import cpu_attention, reference
from streamd.kernels.reference import NO_EXTRAS, LayerExtras

ATTN_IMPLEMENTATION = "streamd"


@dataclass(slots=True)
class AttentionMetadata:
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]
    slot_mapping: torch.Tensor  # int64 [num_tokens]; -1 = do not store (padding)
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_seqs], context length including this step's tokens
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    decode_only: bool  # every sequence has exactly one query token
    ops: ModuleType  # streamd.kernels (Triton) or streamd.kernels.reference (plain torch)
    # An 8-bit pool's scales, float32 [num_blocks, num_layers, 2, num_kv_heads, block_size]; None: a float pool
    kv_scales: torch.Tensor | None = None
    # On the CPU, what every layer of this step shares, planned at its first layer (`cpu_attention`)
    pool_rows: cpu_attention.PoolRows | None = None  # the pool as rows, shared by both plans (`_pool_rows`)
    store_plan: cpu_attention.StorePlan | None = None
    decode_plan: cpu_attention.DecodePlan | None = None
    # The hybrid layout (`worker/kv_groups.py`): per layer (in the window group, its index there), and the
    # window pool's metadata (its cache, slot mapping and block tables); None: one pool holds every layer
    layer_slots: tuple[tuple[bool, int], ...] | None = None
    window: AttentionMetadata | None = None

    @property
    def planned_on_cpu(self) -> bool:
        """The CPU's planned path: a CPU pool with the plain-torch ops (the Triton interpreter tests its own)."""
        return self.kv_cache.device.type == "cpu" and self.ops is reference


def layer_extras(kwargs: dict[str, Any]) -> LayerExtras:
    """From the keywords transformers' attention modules pass (a 0 or None window is no window); the shared
    `NO_EXTRAS` for a layer without any (every layer of a Llama-style model: nothing is built per call)."""
    window, softcap, sinks = kwargs.get("sliding_window") or None, kwargs.get("softcap"), kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None:
        return NO_EXTRAS
    return LayerExtras(window, softcap, sinks)


_context: AttentionMetadata | None = None


def query_token_tables(block_tables: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Each query token's row of its sequence's block table ([num_tokens, max_blocks]), for kernels that take every
    query token as a sequence of its own (a speculative verify or a prompt chunk run as decode rows); no host sync."""
    return block_tables.repeat_interleave(query_start_loc.diff(), dim=0, output_size=num_tokens)


def query_token_lens(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The context each query token attends over as a row of its own (int32 [num_tokens]): its sequence's length less
    the query tokens after it, i.e. its position + 1, so rows that store their K/V before any attends stay causal;
    no host sync."""
    queries = query_start_loc.diff()
    ends = query_start_loc[1:].repeat_interleave(queries, output_size=num_tokens)  # one past its sequence's last
    after = ends - 1 - torch.arange(num_tokens, dtype=ends.dtype, device=ends.device)
    return (seq_lens.repeat_interleave(queries, output_size=num_tokens) - after).to(torch.int32)


def set_attention_metadata(metadata: AttentionMetadata | None) -> None:
    global _context
    _context = metadata


def get_attention_metadata() -> AttentionMetadata:
    if _context is None:
        raise RuntimeError("streamd attention called outside a ModelRunner step")
    return _context


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers calls this with [1, heads, tokens, head_dim] tensors of the flattened batch."""
    md = get_attention_metadata()
    layer = cast(int, module.layer_idx)  # transformers' attention modules know their layer
    if md.layer_slots is not None:  # the hybrid layout: a sliding layer stores into the window pool
        in_window, layer = md.layer_slots[layer]
        if in_window:
            md = cast(AttentionMetadata, md.window)
    q = query[0].transpose(0, 1)  # [tokens, heads, head_dim]
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    store_kv(md, k, v, layer)
    out = paged_attend(md, q, layer, scale, k, v, layer_extras(kwargs))
    return out.unsqueeze(0), None  # transformers wants [batch, tokens, heads, dim]


def paged_attend(
    md: AttentionMetadata,
    query: torch.Tensor,
    layer: int,
    scale: float,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    extras: LayerExtras = NO_EXTRAS,
) -> torch.Tensor:
    """Attention of query [tokens, heads, head_dim] over `layer` of the pool, into which this step's `key`
    and `value` [tokens, kv_heads, head_dim] are stored (None: the caller does not hold them, as the fused
    Triton rotary keeps the rotated key on chip). A prefill hands them on: the reference attends a sequence
    without earlier context (a fresh prompt's single chunk) over them, as transformers does, instead of
    gathering them back out of the pool; the Triton kernel reads the pool either way. `extras` go to the
    kernels as keywords."""
    window, softcap, sinks = extras.sliding_window, extras.softcap, extras.sinks
    if md.decode_only and extras is NO_EXTRAS and md.planned_on_cpu:
        return cpu_attention.decode_attention(query, layer, _decode_plan(md), scale)
    if md.decode_only:
        return md.ops.paged_decode_attention(
            query,
            md.kv_cache,
            layer,
            md.block_tables,
            md.seq_lens,
            scale,
            sliding_window=window,
            softcap=softcap,
            sinks=sinks,
            kv_scales=md.kv_scales,
        )
    return md.ops.paged_prefill_attention(
        query,
        md.kv_cache,
        layer,
        md.block_tables,
        md.query_start_loc,
        md.seq_lens,
        scale,
        key=key,
        value=value,
        sliding_window=window,
        softcap=softcap,
        sinks=sinks,
        kv_scales=md.kv_scales,
    )


def store_kv(md: AttentionMetadata, key: torch.Tensor, value: torch.Tensor, layer: int) -> None:
    if not md.planned_on_cpu:
        md.ops.store_kv(key, value, md.kv_cache, layer, md.slot_mapping, kv_scales=md.kv_scales)
        return
    if md.store_plan is None:
        md.store_plan = cpu_attention.plan_store(md.slot_mapping, _pool_rows(md))
    cpu_attention.store_kv(key, value, layer, md.store_plan)


def _decode_plan(md: AttentionMetadata) -> cpu_attention.DecodePlan:
    if md.decode_plan is None:
        md.decode_plan = cpu_attention.plan_decode(md.block_tables, md.seq_lens, _pool_rows(md))
    return md.decode_plan


def _pool_rows(md: AttentionMetadata) -> cpu_attention.PoolRows:
    if md.pool_rows is None:
        md.pool_rows = cpu_attention.pool_rows(md.kv_cache, md.kv_scales)
    return md.pool_rows


def register_paged_attention() -> None:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
