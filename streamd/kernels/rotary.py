"""Rotary position embedding fused with the paged KV store (Triton).

Owns ``rotary_store_kv``: one program per token rotates that token's query heads (written to a new
tensor the attention kernels read) and its key heads, and stores the rotated key and the value at the
token's slot in one layer of the block-major pool (``slot = block * block_size + offset``; -1 skips
the store, as in ``store_kv``; an 8-bit pool gets each row's codes and scale, `kv_quant`). Optional
per-head RMSNorm of query and key before the rotation (Qwen3's ``q_norm``/``k_norm``) happens in the same
pass. The rotation is transformers' ``rotate_half`` form:
``out = x * cos + cat(-x2, x1) * sin`` with ``x1, x2`` the two halves of the head, and ``cos``, ``sin``
the model's own per-token tables ``[num_tokens, head_dim]`` (so every rope scaling transformers
implements works unchanged).
"""

from __future__ import annotations

import torch
import triton.language as tl

from streamd.kernels._triton_utils import dual_kernel, jit_helper, next_pow2
from streamd.kernels.kv_quant import quantize_halves, scale_args, store_row_scales
from streamd.kernels.layout import check_rotary_args


@jit_helper
def _norm_rotate(
    x1: tl.tensor,
    x2: tl.tensor,
    w_ptr: tl.tensor,
    offs_d: tl.tensor,
    mask_d: tl.tensor,
    cos1: tl.tensor,
    cos2: tl.tensor,
    sin1: tl.tensor,
    sin2: tl.tensor,
    eps: tl.tensor,
    HALF: tl.constexpr,
    QK_NORM: tl.constexpr,
    dtype: tl.constexpr,
) -> tuple[tl.tensor, tl.tensor]:
    """Heads [heads, HALF] as their two float32 halves: per-head RMSNorm by the weights at w_ptr (when
    QK_NORM; rounded to dtype where transformers rounds), then the rotation; both halves in dtype."""
    if QK_NORM:
        inv_rms = (1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps))[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
        x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (x1 * cos1 - x2 * sin1).to(dtype), (x2 * cos2 + x1 * sin2).to(dtype)


@dual_kernel
def _rotary_store_kv_kernel(
    q_ptr: tl.tensor,
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    cos_ptr: tl.tensor,
    sin_ptr: tl.tensor,
    q_out_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    qw_ptr: tl.tensor,
    kw_ptr: tl.tensor,
    layer_off: tl.tensor,
    num_heads: tl.tensor,
    num_kv_heads: tl.tensor,
    eps: tl.tensor,
    s_q_tok: tl.tensor,
    s_q_head: tl.tensor,
    s_k_tok: tl.tensor,
    s_k_head: tl.tensor,
    s_v_tok: tl.tensor,
    s_v_head: tl.tensor,
    s_cos: tl.tensor,
    s_sin: tl.tensor,
    s_qo_tok: tl.tensor,
    s_qo_head: tl.tensor,
    s_kv_blk: tl.tensor,
    s_kv_kv: tl.tensor,
    s_kv_head: tl.tensor,
    s_kv_tok: tl.tensor,
    sc_ptr: tl.tensor,
    sc_layer_off: tl.tensor,
    s_sc_blk: tl.tensor,
    s_sc_kv: tl.tensor,
    s_sc_head: tl.tensor,
    s_sc_tok: tl.tensor,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    PAGE: tl.constexpr,
    QK_NORM: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_INT8: tl.constexpr,
    KV_QMAX: tl.constexpr,
) -> None:
    tok = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask_d = offs_d < HALF
    dtype = q_out_ptr.dtype.element_ty
    cos1 = tl.load(cos_ptr + tok * s_cos + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    cos2 = tl.load(cos_ptr + tok * s_cos + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin1 = tl.load(sin_ptr + tok * s_sin + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    sin2 = tl.load(sin_ptr + tok * s_sin + HALF + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]

    # Query heads: normalise (optional) and rotate, write out.
    offs_hq = tl.arange(0, BLOCK_HQ)
    mask_q = (offs_hq < num_heads)[:, None] & mask_d[None, :]
    src = q_ptr + tok * s_q_tok + offs_hq[:, None] * s_q_head + offs_d[None, :]
    q1, q2 = _norm_rotate(
        tl.load(src, mask=mask_q, other=0.0).to(tl.float32),
        tl.load(src + HALF, mask=mask_q, other=0.0).to(tl.float32),
        qw_ptr,
        offs_d,
        mask_d,
        cos1,
        cos2,
        sin1,
        sin2,
        eps,
        HALF,
        QK_NORM,
        dtype,
    )
    dst = q_out_ptr + tok * s_qo_tok + offs_hq[:, None] * s_qo_head + offs_d[None, :]
    tl.store(dst, q1, mask=mask_q)
    tl.store(dst + HALF, q2, mask=mask_q)

    # Key heads: the same, then key and value go to the token's slot. The slot is loaded once per head
    # row (a block-shaped validity mask: the interpreter mishandles `block & scalar-bool`).
    offs_hk = tl.arange(0, BLOCK_HK)
    slot = tl.load(slot_ptr + tok + offs_hk * 0).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    mask_k = (offs_hk < num_kv_heads)[:, None] & mask_d[None, :]
    mask_kv = mask_k & valid[:, None]
    src = k_ptr + tok * s_k_tok + offs_hk[:, None] * s_k_head + offs_d[None, :]
    # Rounded to the activations' dtype first, as the unfused path stores the rotated key it computed.
    k1, k2 = _norm_rotate(
        tl.load(src, mask=mask_kv, other=0.0).to(tl.float32),
        tl.load(src + HALF, mask=mask_kv, other=0.0).to(tl.float32),
        kw_ptr,
        offs_d,
        mask_d,
        cos1,
        cos2,
        sin1,
        sin2,
        eps,
        HALF,
        QK_NORM,
        dtype,
    )
    src = v_ptr + tok * s_v_tok + offs_hk[:, None] * s_v_head + offs_d[None, :]
    v1 = tl.load(src, mask=mask_kv, other=0.0)
    v2 = tl.load(src + HALF, mask=mask_kv, other=0.0)
    cache_dtype = kv_ptr.dtype.element_ty
    dst = (
        kv_ptr
        + layer_off
        + (slot // PAGE)[:, None] * s_kv_blk
        + (slot % PAGE)[:, None] * s_kv_tok
        + offs_hk[:, None] * s_kv_head
        + offs_d[None, :]
    )
    if KV_QUANT:
        k1, k2, k_scale = quantize_halves(k1, k2, KV_QMAX, KV_INT8)
        v1, v2, v_scale = quantize_halves(v1, v2, KV_QMAX, KV_INT8)
        row_mask = valid & (offs_hk < num_kv_heads)
        store_row_scales(
            sc_ptr + sc_layer_off,
            slot,
            offs_hk,
            row_mask,
            k_scale,
            v_scale,
            s_sc_blk,
            s_sc_kv,
            s_sc_head,
            s_sc_tok,
            PAGE,
        )
    tl.store(dst, k1.to(cache_dtype), mask=mask_kv)
    tl.store(dst + HALF, k2.to(cache_dtype), mask=mask_kv)
    tl.store(dst + s_kv_kv, v1.to(cache_dtype), mask=mask_kv)
    tl.store(dst + s_kv_kv + HALF, v2.to(cache_dtype), mask=mask_kv)


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
    """Returns the rotated query [num_tokens, num_heads, head_dim] (contiguous, query's dtype); stores the
    rotated key and the value of token t at slot_mapping[t] of `layer` (-1: not stored).

    query, key, value [num_tokens, heads, head_dim] with unit stride along head_dim (slices of a fused QKV
    projection are fine); cos, sin [num_tokens, head_dim]; q_norm, k_norm: per-head RMSNorm weights
    [head_dim], both or neither, applied before the rotation.
    """
    check_rotary_args(query, key, value, cos, sin, kv_cache, layer, q_norm, k_norm)
    scales = scale_args(kv_cache, kv_scales, layer)
    num_tokens, num_heads, head_dim = query.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    tensors = [query, key, value, cos, sin]
    if any(t.stride(-1) != 1 for t in tensors) or kv_cache.stride(5) != 1:
        raise ValueError("rotary_store_kv wants unit stride along head_dim for every input and the cache")
    half = head_dim // 2
    s_kv = kv_cache.stride()
    qk_norm = q_norm is not None
    _rotary_store_kv_kernel.launch(
        query.device,
        (num_tokens,),
        query,
        key,
        value,
        cos,
        sin,
        out,
        kv_cache,
        slot_mapping,
        q_norm if qk_norm else cos,
        k_norm if qk_norm else cos,
        layer * s_kv[1],
        num_heads,
        key.shape[1],
        eps,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos.stride(0),
        sin.stride(0),
        out.stride(0),
        out.stride(1),
        s_kv[0],
        s_kv[2],
        s_kv[3],
        s_kv[4],
        *scales.args,
        HALF=half,
        BLOCK_HALF=next_pow2(half),
        BLOCK_HQ=next_pow2(num_heads),
        BLOCK_HK=next_pow2(key.shape[1]),
        PAGE=kv_cache.shape[4],
        QK_NORM=qk_norm,
        **scales.flags,
        num_warps=4,
    )
    return out


__all__ = ["rotary_store_kv"]
