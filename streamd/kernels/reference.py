"""Plain-torch references for the paged-attention kernels, with the same signatures.

Owns the semantics: the Triton kernels are tested against these, and the engine runs these on CPU.
They work on CPU and CUDA tensors, accumulate in float32 (through SDPA, which keeps bf16 operands but
accumulates in float32, as the Triton kernels do) and return the query's dtype. Unlike the Triton
versions they may synchronise with the host (CPU is their production target): the decode reference
trims the block table to the longest context on CPU, the prefill reference loops over sequences, and
``store_kv`` drops ``-1`` slots with a boolean mask. The decoder-layer references (RMSNorm, SiLU-and-mul,
rotary) are transformers' own arithmetic, op for op in the activations' dtype, so a model rewired onto
them computes what the unfused model computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamd.kernels.layout import check_cache, check_rotary_args


def _layer_view(kv_cache: torch.Tensor, layer: int) -> torch.Tensor:
    """[num_blocks, 2, num_kv_heads, block_size, head_dim] view of one layer (no copy)."""
    check_cache(kv_cache, layer)
    return kv_cache[:, layer]


def _compute_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """SDPA's own kernels accumulate bf16 in float32 (as the Triton kernels do); CPU fp16 is upcast."""
    return torch.float32 if dtype == torch.float16 and device.type == "cpu" else dtype


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention by one batched gather of every sequence's blocks (see the Triton version).

    The G query heads of a KV head become G query rows of one SDPA "sequence" over that head's keys,
    so GQA needs no repeated K/V.
    """
    kv = _layer_view(kv_cache, layer)
    num_seqs, num_heads, head_dim = query.shape
    _, _, num_kv_heads, page, _ = kv.shape
    group = num_heads // num_kv_heads
    seq_lens = seq_lens.to(device=query.device, dtype=torch.long)
    tables = block_tables.to(device=query.device, dtype=torch.long)
    if query.device.type == "cpu" and num_seqs > 0:
        # On CPU a sync is free: gather only as many blocks as the longest context needs.
        max_blocks = max(1, -(-int(seq_lens.max()) // page))
        tables = tables[:, :max_blocks]
    n_blocks = tables.shape[1]
    context = n_blocks * page
    # Padded table entries may hold anything: point them at block 0 (read, then masked out).
    used = torch.arange(n_blocks, device=query.device)[None, :] * page < seq_lens[:, None]
    tables = torch.where(used, tables, torch.zeros_like(tables))

    # Indexing [block, k|v, head] with [S,1,1,n_blocks] x [1,2,1,1] x [1,1,Hkv,1] gathers straight
    # into [S, 2, Hkv, n_blocks, page, D]: contiguous, so the reshape to [.., T, D] is free.
    dev = query.device
    kv_idx = torch.arange(2, device=dev)[None, :, None, None]
    heads = torch.arange(num_kv_heads, device=dev)[None, None, :, None]
    gathered = kv[tables[:, None, None, :], kv_idx, heads].reshape(num_seqs, 2, num_kv_heads, context, head_dim)
    valid = torch.arange(context, device=dev)[None, :] < seq_lens[:, None]  # [S, T]
    # Slots past seq_len hold stale data, possibly NaN bit patterns: a masked score of NaN stays NaN
    # and 0 * NaN is NaN, so zero them before the matmuls.
    dtype = _compute_dtype(query.dtype, dev)
    gathered = gathered.to(dtype).masked_fill(~valid[:, None, None, :, None], 0.0)
    k, v = gathered[:, 0], gathered[:, 1]
    q = query.to(dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    o = torch.where((seq_lens > 0)[:, None, None, None], o, 0.0)  # seq_len 0: zeros, not NaN
    result = o.reshape(num_seqs, num_heads, head_dim)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's last query_len tokens over its whole paged context.

    Query token j of sequence i sits at position seq_len_i - query_len_i + j and attends to positions
    <= that. Rows of ``query`` outside every sequence's range are left as they are in ``out`` (zeros
    when ``out`` is not given). ``key``, ``value`` [num_tokens, num_kv_heads, head_dim]: the step's K/V,
    already stored in the pool at the queries' slots (both or neither); a sequence without earlier context
    (a fresh prompt's single chunk) then attends over its slice of them instead of gathering them back.
    """
    kv = _layer_view(kv_cache, layer)
    _num_tokens, _num_heads, head_dim = query.shape
    _, _, num_kv_heads, page, _ = kv.shape
    if (key is None) != (value is None):
        raise ValueError("paged_prefill_attention takes the step's key and value together, or neither")
    if out is None:
        out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    tables = block_tables.to(device=query.device, dtype=torch.long)
    dtype = _compute_dtype(query.dtype, query.device)
    for i, seq_len in enumerate(lens):
        q_begin, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_begin
        if q_len <= 0 or seq_len <= 0:
            continue
        ctx = seq_len - q_len
        # 4-D [1, heads, tokens, D]: with 3-D tensors CPU SDPA falls back to its generic math path (~6x slower).
        q = query[q_begin:q_end].to(dtype).transpose(0, 1)[None]  # [1, H, q_len, D]
        if ctx == 0 and key is not None and value is not None:
            k = key[q_begin:q_end].to(dtype).transpose(0, 1)[None]  # [1, Hkv, T, D]
            v = value[q_begin:q_end].to(dtype).transpose(0, 1)[None]
        else:
            n_blocks = -(-seq_len // page)
            kv_seq = kv[tables[i, :n_blocks]]  # [n_blocks, 2, Hkv, page, D]
            kv_seq = kv_seq.permute(1, 2, 0, 3, 4).reshape(2, num_kv_heads, n_blocks * page, head_dim)
            k = kv_seq[0, :, :seq_len].to(dtype)[None]  # [1, Hkv, T, D]
            v = kv_seq[1, :, :seq_len].to(dtype)[None]
        if ctx == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[q_begin:q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's key/value at slot_mapping[t] (= block * block_size + offset); -1 is skipped."""
    kv = _layer_view(kv_cache, layer)
    page = kv.shape[3]
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    blk = slots // page
    off = slots % page
    # Advanced indices split by a slice: the indexed result is [n, num_kv_heads, head_dim].
    kv[blk, 0, :, off] = key[keep].to(kv_cache.dtype)
    kv[blk, 1, :, off] = value[keep].to(kv_cache.dtype)


def copy_blocks(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """kv_cache[dst[i]] = kv_cache[src[i]] for every i (all layers, K and V); dst blocks are distinct."""
    if src.numel() == 0:
        return
    src = src.to(device=kv_cache.device, dtype=torch.long)
    dst = dst.to(device=kv_cache.device, dtype=torch.long)
    kv_cache[dst] = kv_cache[src]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)), normalised in float32 and rounded to x's dtype first."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual); inputs untouched."""
    summed = x + residual
    return rmsnorm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [rows, 2 * inter] (gate, then up) -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated (and, with q_norm/k_norm, first per-head normalised) query and key, as transformers
    computes them; [num_tokens, heads, head_dim] each, cos/sin [num_tokens, head_dim]."""
    if q_norm is not None and k_norm is not None:
        query, key = rmsnorm(query, q_norm, eps), rmsnorm(key, k_norm, eps)
    cos, sin = cos[:, None], sin[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def rotary_store_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """`rotary`, then `store_kv` of the rotated key and the value; returns the rotated query."""
    check_rotary_args(query, key, value, cos, sin, kv_cache, layer, q_norm, k_norm)
    query, key = rotary(query, key, cos, sin, q_norm, k_norm, eps)
    store_kv(key, value, kv_cache, layer, slot_mapping)
    return query.contiguous()


__all__ = [
    "copy_blocks",
    "fused_add_rmsnorm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rmsnorm",
    "rotary",
    "rotary_store_kv",
    "silu_and_mul",
    "store_kv",
]
