"""Plain-torch references for the paged-attention kernels, with the same signatures.

Owns the semantics: the Triton kernels are tested against these, and the engine runs these on CPU.
They work on CPU and CUDA tensors, accumulate in float32 (through SDPA, which keeps bf16 operands but
accumulates in float32, as the Triton kernels do) and return the query's dtype. Unlike the Triton
versions they may synchronise with the host (CPU is their production target): the decode reference
trims the block table to the longest context on CPU, the prefill reference loops over sequences, and
``store_kv`` drops ``-1`` slots with a boolean mask. The decoder-layer references (RMSNorm, SiLU-and-mul,
rotary) are transformers' own arithmetic, op for op in the activations' dtype, so a model rewired onto
them computes what the unfused model computes. The FP8 ones (`quantize_fp8`, the norms and SiLU-and-mul
writing e4m3 rows, `fp8_product`, `fp8_matmul`) quantize as `layout.quantize_rows` does and multiply the codes
exactly (float64), so they are what `Fp8Linear` computes off CUDA.

Both attention references take transformers' per-layer extras as keywords (None: off): ``sliding_window``
W (a query at position p sees the keys p - W < k <= p, as transformers' ``sliding_window_overlay``: W
tokens, itself included), ``softcap`` c (Gemma 2: every logit becomes c * tanh(logit / c) before the mask)
and ``sinks`` (gpt-oss: one learned logit per query head that joins the softmax's denominator only, the
extra column transformers appends and then drops). With neither softcap nor sinks they stay on SDPA (the
mask carries the window); with either, the scores are spelled out in float32.

An 8-bit pool (`layout.KV_QUANT_DTYPES`) comes with ``kv_scales``: the stores quantize each (token, KV head)
row (`layout.quantize_rows`) and the attentions dequantize what they gather, to the query's dtype, so every
key and value attended over is the one the pool holds (a fresh prompt's too: its float K/V are not used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from streamd.kernels.layout import (
    FP8,
    Fp8Rows,
    check_cache,
    check_rotary_args,
    check_scales,
    dequantize_rows,
    product_dtype,
    quantize_rows,
    write_kv_rows,
)


def _layer_view(kv_cache: torch.Tensor, layer: int, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """[num_blocks, 2, num_kv_heads, block_size, head_dim] view of one layer (no copy)."""
    check_cache(kv_cache, layer)
    check_scales(kv_cache, kv_scales)
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
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention by one batched gather of every sequence's blocks (see the Triton version).

    The G query heads of a KV head become G query rows of one SDPA "sequence" over that head's keys,
    so GQA needs no repeated K/V. With a window only the blocks that hold its last W positions are
    gathered (column 0 of the gathered table is each sequence's block ``first // page``).
    """
    kv = _layer_view(kv_cache, layer, kv_scales)
    num_seqs, num_heads, head_dim = query.shape
    _, _, num_kv_heads, page, _ = kv.shape
    group = num_heads // num_kv_heads
    seq_lens = seq_lens.to(device=query.device, dtype=torch.long)
    tables = block_tables.to(device=query.device, dtype=torch.long)
    if query.device.type == "cpu" and num_seqs > 0:
        # On CPU a sync is free: gather only as many blocks as the longest context needs.
        max_blocks = max(1, -(-int(seq_lens.max()) // page))
        tables = tables[:, :max_blocks]
    dev = query.device
    first = None  # with a window: each sequence's first visible position
    base: torch.Tensor | int = 0  # position of gathered column 0, per sequence
    if sliding_window is not None:
        first = (seq_lens - sliding_window).clamp_min(0)
        tables = _window_columns(tables, first // page, sliding_window, page)
        base = (first // page * page)[:, None]
    n_blocks = tables.shape[1]
    context = n_blocks * page
    # Padded table entries may hold anything: point them at block 0 (read, then masked out).
    used = base + torch.arange(n_blocks, device=dev)[None, :] * page < seq_lens[:, None]
    tables = torch.where(used, tables, torch.zeros_like(tables))

    # Indexing [block, k|v, head] with [S,1,1,n_blocks] x [1,2,1,1] x [1,1,Hkv,1] gathers straight
    # into [S, 2, Hkv, n_blocks, page, D]: contiguous, so the reshape to [.., T, D] is free.
    kv_idx = torch.arange(2, device=dev)[None, :, None, None]
    heads = torch.arange(num_kv_heads, device=dev)[None, None, :, None]
    gathered = kv[tables[:, None, None, :], kv_idx, heads].reshape(num_seqs, 2, num_kv_heads, context, head_dim)
    if kv_scales is not None:
        scales = kv_scales[:, layer][tables[:, None, None, :], kv_idx, heads].reshape(
            num_seqs, 2, num_kv_heads, context
        )
        gathered = dequantize_rows(gathered, scales, query.dtype)
    pos = base + torch.arange(context, device=dev)[None, :]
    valid = pos < seq_lens[:, None]  # [S, T]
    if first is not None:
        valid &= pos >= first[:, None]
    # Slots past seq_len hold stale data, possibly NaN bit patterns: a masked score of NaN stays NaN
    # and 0 * NaN is NaN, so zero them before the matmuls.
    dtype = _compute_dtype(query.dtype, dev)
    gathered = gathered.to(dtype).masked_fill(~valid[:, None, None, :, None], 0.0)
    k, v = gathered[:, 0], gathered[:, 1]
    q = query.to(dtype).reshape(num_seqs, num_kv_heads, group, head_dim)
    sink_rows = None if sinks is None else sinks.reshape(1, num_kv_heads, group, 1)
    o = _attend(q, k, v, valid[:, None, None, :], scale, softcap, sink_rows)
    o = torch.where((seq_lens > 0)[:, None, None, None], o, 0.0)  # seq_len 0: zeros, not NaN
    result = o.reshape(num_seqs, num_heads, head_dim)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def _window_columns(tables: torch.Tensor, first_block: torch.Tensor, window: int, page: int) -> torch.Tensor:
    """Each row's table from column ``first_block``, as many columns as a window of ``window`` positions
    can touch (out-of-range columns repeat the last one; their positions are masked)."""
    width = min(tables.shape[1], -(-(window + page - 1) // page))
    cols = first_block[:, None] + torch.arange(width, device=tables.device)[None, :]
    return tables.gather(1, cols.clamp_max(tables.shape[1] - 1))


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of q [B, Hkv, rows, D] over k, v [B, Hkv, T, D] where ``mask`` (broadcast to
    [B, Hkv, rows, T]) allows; ``sinks`` broadcasts to [B, Hkv, rows, 1]. A row that sees nothing gives
    NaN (no sinks) or zeros (sinks): callers zero or never read such rows."""
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink_col = sinks.float().expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)


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
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's last query_len tokens over its whole paged context.

    Query token j of sequence i sits at position seq_len_i - query_len_i + j and attends to positions
    <= that (and, with a window W, > that - W). Rows of ``query`` outside every sequence's range are
    left as they are in ``out`` (zeros when ``out`` is not given). ``key``, ``value`` [num_tokens,
    num_kv_heads, head_dim]: the step's K/V, already stored in the pool at the queries' slots (both or
    neither); a sequence without earlier context (a fresh prompt's single chunk) then attends over its
    slice of them instead of gathering them back. With a window, a sequence with earlier context gathers
    only the blocks its first query can still see.
    """
    kv = _layer_view(kv_cache, layer, kv_scales)
    layer_scales = None if kv_scales is None else kv_scales[:, layer]
    if (key is None) != (value is None):
        raise ValueError("paged_prefill_attention takes the step's key and value together, or neither")
    if out is None:
        out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    tables = block_tables.to(device=query.device, dtype=torch.long)
    dtype = _compute_dtype(query.dtype, query.device)
    extras = LayerExtras(sliding_window, softcap, sinks)
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_begin, q_end = starts[i], starts[i + 1]
        if q_end <= q_begin or seq_len <= 0:
            continue
        q = query[q_begin:q_end].to(dtype).transpose(0, 1)[None]  # [1, H, q_len, D]
        step_kv = None  # (an 8-bit pool: its stored codes x scales are read back, not the float K/V)
        if key is not None and value is not None and layer_scales is None:
            step_kv = (key[q_begin:q_end], value[q_begin:q_end])
        k, v, first_key = _prefill_keys(kv, tables[i], seq_len, q_end - q_begin, step_kv, sliding_window, layer_scales)
        o = _prefill_one(q, k.to(dtype), v.to(dtype), seq_len, first_key, scale, extras)
        out[q_begin:q_end] = o[0].transpose(0, 1).to(out.dtype)
    return out


@dataclass(frozen=True, slots=True)
class LayerExtras:
    """A layer's attention extras, transformers' (None: off; all None for a Llama layer, whose kernels compile
    without them). The one record of them: `engine/worker/attention.py` builds it from transformers' keywords."""

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


NO_EXTRAS = LayerExtras()


def _prefill_keys(
    kv: torch.Tensor,
    table: torch.Tensor,
    seq_len: int,
    q_len: int,
    step_kv: tuple[torch.Tensor, torch.Tensor] | None,
    window: int | None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(k, v) [1, Hkv, T, D] of one sequence and the position of their first row: the step's own K/V for
    a fresh prompt's single chunk, else the pool's blocks from the first one the first query can see
    (dequantized by the layer's `scales` [num_blocks, 2, Hkv, page] of an 8-bit pool, to float32)."""
    ctx = seq_len - q_len
    if ctx == 0 and step_kv is not None:
        return step_kv[0].transpose(0, 1)[None], step_kv[1].transpose(0, 1)[None], 0
    page = kv.shape[3]
    first_block = 0 if window is None else max(0, ctx + 1 - window) // page
    n_blocks = -(-seq_len // page) - first_block
    kv_seq = kv[table[first_block : first_block + n_blocks]]  # [n_blocks, 2, Hkv, page, D]
    if scales is not None:
        kv_seq = dequantize_rows(kv_seq, scales[table[first_block : first_block + n_blocks]], torch.float32)
    kv_seq = kv_seq.permute(1, 2, 0, 3, 4).flatten(2, 3)  # [2, Hkv, n_blocks * page, D]
    first_key = first_block * page
    return kv_seq[0, :, : seq_len - first_key][None], kv_seq[1, :, : seq_len - first_key][None], first_key


def _prefill_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int, first_key: int, scale: float, extras: LayerExtras
) -> torch.Tensor:
    """Attention of q [1, H, q_len, D] (the last q_len positions) over k, v [1, Hkv, T, D] (positions
    first_key..seq_len-1). 4-D tensors: with 3-D ones CPU SDPA falls back to its generic math path (~6x slower)."""
    q_len, window = q.shape[2], extras.sliding_window
    if window is not None and window >= seq_len:
        window = None  # wider than the context: plain causal
    plain = extras.softcap is None and extras.sinks is None
    if plain and window is None and first_key == 0 and q_len == seq_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(first_key, seq_len, device=q.device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    if plain:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[3]
    group = num_heads // num_kv_heads
    rows = q.reshape(1, num_kv_heads, group * q_len, head_dim)  # row g * q_len + t: head kv * G + g, token t
    sinks = None
    if extras.sinks is not None:
        sinks = extras.sinks.reshape(1, num_kv_heads, group, 1, 1).expand(-1, -1, -1, q_len, -1).flatten(2, 3)
    o = _attend(rows, k, v, mask.repeat(group, 1), scale, extras.softcap, sinks)
    return o.reshape(1, num_heads, q_len, head_dim)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write token t's key/value at slot_mapping[t] (= block * block_size + offset); -1 is skipped. An 8-bit
    pool gets each row's codes and, in `kv_scales`, its scale."""
    kv = _layer_view(kv_cache, layer, kv_scales)
    page = kv.shape[3]
    slots = slot_mapping.to(device=kv_cache.device, dtype=torch.long)
    keep = slots >= 0
    slots = slots[keep]
    blk = slots // page
    off = slots % page
    # Advanced indices split by a slice: the indexed rows are [n, num_kv_heads, head_dim].
    write_kv_rows(kv, None if kv_scales is None else kv_scales[:, layer], blk, off, key[keep], value[keep])


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


def quantize_fp8(x: torch.Tensor) -> Fp8Rows:
    """x [rows, cols] -> e4m3 codes and float32 row scales (`layout.quantize_rows`)."""
    return Fp8Rows(*quantize_rows(x, FP8), x.dtype)


def rmsnorm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """`rmsnorm`'s rows (rounded to x's dtype), quantized."""
    return quantize_fp8(rmsnorm(x, weight, eps))


def fused_add_rmsnorm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Rows, torch.Tensor]:
    """`fused_add_rmsnorm` with its normalised rows quantized."""
    normed, summed = fused_add_rmsnorm(x, residual, weight, eps)
    return quantize_fp8(normed), summed


def silu_and_mul_fp8(x: torch.Tensor, scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> Fp8Rows:
    """`silu_and_mul`'s rows (rounded to x's dtype), quantized; `scales` (rows, columns): x is an FP8 product,
    scaled first and rounded to its dtype."""
    if scales is not None:
        x = (x.float() * scales[0][:, None] * scales[1][None, :]).to(x.dtype)
    return quantize_fp8(silu_and_mul(x))


def _codes_product(x: Fp8Rows, codes: torch.Tensor) -> torch.Tensor:
    """x.codes @ codes.T in float64: exact for these sizes, and free of a GPU's TF32."""
    return x.codes.double() @ codes.double().t()


def fp8_product(x: Fp8Rows, codes: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """x.codes @ codes.T unscaled, in `product_dtype(out_dtype)`."""
    return _codes_product(x, codes).to(product_dtype(out_dtype))


def fp8_matmul(
    x: Fp8Rows,
    codes: torch.Tensor,
    scales: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(x.codes * x.scales) @ (codes * scales).T + bias in float64, rounded once to `out_dtype`."""
    out = _codes_product(x, codes) * x.scales[:, None].double() * scales[None, :].double()
    return (out if bias is None else out + bias.double()).to(out_dtype)


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
    return rotate(query, cos, sin), rotate(key, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary arithmetic, x * cos + rotate_half(x) * sin, on x [num_tokens, heads, head_dim] with
    cos/sin [num_tokens, head_dim] (q and k side by side rotate as one x: the CPU's fused path)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


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
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rotary`, then `store_kv` of the rotated key and the value; returns the rotated query."""
    check_rotary_args(query, key, value, cos, sin, kv_cache, layer, q_norm, k_norm)
    query, key = rotary(query, key, cos, sin, q_norm, k_norm, eps)
    store_kv(key, value, kv_cache, layer, slot_mapping, kv_scales)
    return query.contiguous()


__all__ = [
    "copy_blocks",
    "fused_add_rmsnorm",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rmsnorm",
    "rotary",
    "rotary_store_kv",
    "rotate",
    "silu_and_mul",
    "store_kv",
]
