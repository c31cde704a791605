"""Fused store of new tokens' keys and values into the paged KV cache (Triton).

Owns ``store_kv``: one program per (token, group of KV heads) reads that token's key and value rows
(any strides, so slices of a fused QKV projection need no copy) and writes them at the token's slot,
``slot = block * block_size + offset``, in one layer of the block-major pool. Slot -1 (padding, or a
token whose K/V must not be written) is skipped. The cast to the cache's dtype happens in the store; an 8-bit
pool gets each (token, head) row's codes and its scale (`kv_quant`).
"""

from __future__ import annotations

import torch
import triton.language as tl

from streamd.kernels._triton_utils import cdiv, dual_kernel, next_pow2
from streamd.kernels.kv_quant import quantize_rows, scale_args, store_row_scales
from streamd.kernels.layout import check_cache

# Elements one program moves per tensor: enough to keep loads wide, small enough for registers.
_MAX_TILE = 4096


@dual_kernel
def _store_kv_kernel(
    k_ptr: tl.tensor,
    v_ptr: tl.tensor,
    kv_ptr: tl.tensor,
    slot_ptr: tl.tensor,
    layer_off: tl.tensor,
    num_kv_heads: tl.tensor,
    s_k_tok: tl.tensor,
    s_k_head: tl.tensor,
    s_k_dim: tl.tensor,
    s_v_tok: tl.tensor,
    s_v_head: tl.tensor,
    s_v_dim: tl.tensor,
    s_kv_blk: tl.tensor,
    s_kv_kv: tl.tensor,
    s_kv_head: tl.tensor,
    s_kv_tok: tl.tensor,
    s_kv_dim: tl.tensor,
    sc_ptr: tl.tensor,
    sc_layer_off: tl.tensor,
    s_sc_blk: tl.tensor,
    s_sc_kv: tl.tensor,
    s_sc_head: tl.tensor,
    s_sc_tok: tl.tensor,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_INT8: tl.constexpr,
    KV_QMAX: tl.constexpr,
) -> None:
    tok = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # The slot is loaded once per head row (same address, one transaction): a block-shaped validity
    # mask, since the interpreter mishandles `block & scalar-bool`.
    slot = tl.load(slot_ptr + tok + offs_h * 0).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)  # keep even the masked-off address arithmetic in range
    blk = (slot // PAGE)[:, None]
    off = (slot % PAGE)[:, None]
    mask = (valid & (offs_h < num_kv_heads))[:, None] & (offs_d[None, :] < HEAD_DIM)

    tok64 = tok.to(tl.int64)
    key = tl.load(
        k_ptr + tok64 * s_k_tok + offs_h[:, None] * s_k_head + offs_d[None, :] * s_k_dim, mask=mask, other=0.0
    )
    val = tl.load(
        v_ptr + tok64 * s_v_tok + offs_h[:, None] * s_v_head + offs_d[None, :] * s_v_dim, mask=mask, other=0.0
    )
    dst = (
        kv_ptr + layer_off + blk * s_kv_blk + off * s_kv_tok + offs_h[:, None] * s_kv_head + offs_d[None, :] * s_kv_dim
    )
    cache_dtype = kv_ptr.dtype.element_ty
    if KV_QUANT:
        key, k_scale = quantize_rows(key, KV_QMAX, KV_INT8)
        val, v_scale = quantize_rows(val, KV_QMAX, KV_INT8)
        row_mask = valid & (offs_h < num_kv_heads)  # one scale per (token, head) row
        store_row_scales(
            sc_ptr + sc_layer_off,
            slot,
            offs_h,
            row_mask,
            k_scale,
            v_scale,
            s_sc_blk,
            s_sc_kv,
            s_sc_head,
            s_sc_tok,
            PAGE,
        )
    tl.store(dst, key.to(cache_dtype), mask=mask)
    tl.store(dst + s_kv_kv, val.to(cache_dtype), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """In place: kv_cache[slot // block_size, layer, 0|1, :, slot % block_size] = key|value per token.

    key, value [num_tokens, num_kv_heads, head_dim] (any strides); slot_mapping int64 [num_tokens],
    -1 entries skipped. Two tokens mapping to one slot is undefined (the engine never does it). An 8-bit pool
    takes its `kv_scales` (`layout.check_scales`).
    """
    check_cache(kv_cache, layer)
    scales = scale_args(kv_cache, kv_scales, layer)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if kv_cache.shape[3] != num_kv_heads or kv_cache.shape[5] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match cache {tuple(kv_cache.shape)}")
    if num_tokens == 0:
        return
    block_d = next_pow2(head_dim)
    block_h = min(next_pow2(num_kv_heads), max(1, _MAX_TILE // block_d))
    s_kv = kv_cache.stride()
    _store_kv_kernel.launch(
        key.device,
        (num_tokens, cdiv(num_kv_heads, block_h)),
        key,
        value,
        kv_cache,
        slot_mapping,
        layer * s_kv[1],
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        s_kv[0],
        s_kv[2],
        s_kv[3],
        s_kv[4],
        s_kv[5],
        *scales.args,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        PAGE=kv_cache.shape[4],
        **scales.flags,
        num_warps=4,
    )


__all__ = ["store_kv"]
